from components.clean_data.stage import main

main()
