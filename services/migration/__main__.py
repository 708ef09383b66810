from loom_services.migration.main import main

main()
