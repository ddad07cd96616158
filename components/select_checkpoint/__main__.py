from components.select_checkpoint.stage import main

main()
