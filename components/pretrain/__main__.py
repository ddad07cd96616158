from components.pretrain.stage import main

main()
