from pipelines.qvl.app import main

main()
