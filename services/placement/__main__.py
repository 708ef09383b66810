from loom_services.placement.main import main

main()
