"""The web console: server-rendered pages, live job state over server-sent events."""
