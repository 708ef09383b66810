from loom_services.network_perception.main import main

main()
