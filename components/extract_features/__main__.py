from components.extract_features.stage import main

main()
