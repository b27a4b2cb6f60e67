#!/bin/sh
# Patroni's bootstrap.post_bootstrap: run once, on the node that initialised the cluster, with the superuser's
# connection URL as $1 (Patroni sets PGPASSFILE): the registry's database, its owner and the components' logins. The
# standbys get them by replication.
set -eu
exec psql "$1" -v ON_ERROR_STOP=1 -f /etc/patroni/10-photon.sql
