from components.sft.stage import main

main()
