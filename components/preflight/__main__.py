from components.preflight.stage import main

main()
