from loom_services.probe_collector.main import main

main()
