from loom_services.metrics.main import main

main()
