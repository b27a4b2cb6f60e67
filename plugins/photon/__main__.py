from photon.cli import main

main()
