from photon.cli import main

if __name__ == "__main__":  # Airflow's plugin manager imports every file under plugins/: do nothing then
    main()
