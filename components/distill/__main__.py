from components.distill.stage import main

main()
