from loom_services.console.main import main

main()
