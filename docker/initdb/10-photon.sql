-- The IdRegistry's database and owner beside Airflow's metadata database (run once, on an empty volume).
CREATE ROLE photon LOGIN PASSWORD 'photon';
CREATE DATABASE photon OWNER photon;
