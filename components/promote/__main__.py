from components.promote.stage import main

main()
