from loom_services.alert_correlator.main import main

main()
