from swarmtrain.cli.main import main

main()
