from components.rl.stage import main

main()
