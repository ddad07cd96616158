from components.reward_model.stage import main

main()
