from storyboard_cli.cli import main

main()
