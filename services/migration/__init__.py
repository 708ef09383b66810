"""The migration service: drains, checkpoint-boundary moves and the record of every migration."""
