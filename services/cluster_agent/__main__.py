from loom_services.cluster_agent.main import main

main()
