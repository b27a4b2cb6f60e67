# The two commands a newcomer needs: `make demo` (set up, run the main job on embedded defaults) and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
REQ_HASH := $(shell cat requirements.txt | sha256sum | cut -c1-16)
# The environment is cached outside the clone, keyed by the requirements' hash, so a fresh clone reuses it.
# As root, the embedded PostgreSQL runs as an unprivileged user that must reach the venv's server binaries, and
# root's home is private (700): so root's cache lives under /var/tmp instead.
VENV_ROOT ?= $(if $(filter 0,$(shell id -u)),/var/tmp/photon/venvs,$(HOME)/.cache/photon/venvs)
VENV := $(VENV_ROOT)/$(REQ_HASH)
PY := $(VENV)/bin/python
# Data Docs offline: the npm packages behind the CDN links of GX's pages (plugins/photon/tools/data_docs), beside the
# venv.
DATA_DOCS_ASSETS := $(VENV)/share/photon-data-docs
export PYTHONPATH := $(CURDIR)/plugins:$(CURDIR)
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: shell setup test test-long fuzz lint demo airflow bench-registry bench-generator bench-pipeline bench-discovery bench-handover bench-handover-airflow bench-quality bench-parse bench-table bench-object-store lock clean-state chaos

# The venv is shared by clones with the same requirements; the `photon` package is installed editable from the clone
# that ran `make setup` last (tests import their own clone's code through PYTHONPATH). `.venv` links to it, so
# `.venv/bin/photon` (or `source .venv/bin/activate`, or `make shell`) is the command line.
setup: $(VENV)/.ready
	@grep -qxF "$(CURDIR)/plugins" $(VENV)/lib/python3*/site-packages/_photon_airflow.pth 2>/dev/null \
	  || "$(VENV)/bin/pip" install --quiet --no-deps --no-build-isolation -e .
	@ln -sfn "$(VENV)" .venv
	@cmp -s plugins/photon/tools/data_docs/package-lock.json "$(DATA_DOCS_ASSETS)/.installed-lock.json" \
	  || $(MAKE) --no-print-directory data-docs-assets
	@test -x /usr/bin/chromium || $(MAKE) --no-print-directory chromium
	@test -x /usr/bin/faketime || $(MAKE) --no-print-directory faketime
	@test -x /usr/bin/etcd || $(MAKE) --no-print-directory etcd

.PHONY: data-docs-assets chromium faketime etcd
# The CSS/JS that GX's Data Docs pages name, from the very npm packages (and versions) their CDN links serve, pinned
# with integrity hashes by plugins/photon/tools/data_docs/package-lock.json; photon.tools.quality copies the few files
# a page loads into the site, so it renders offline. Reinstalled whenever the lock changes.
data-docs-assets:
	@command -v npm >/dev/null \
	  || { echo "make setup: npm is missing, so Data Docs will need the network: apt-get install -y npm"; exit 0; }; \
	  set -e; echo "== Data Docs assets (npm ci) into $(DATA_DOCS_ASSETS)"; rm -rf "$(DATA_DOCS_ASSETS)"; \
	  mkdir -p "$(DATA_DOCS_ASSETS)"; \
	  cp plugins/photon/tools/data_docs/{package.json,package-lock.json,.npmrc} "$(DATA_DOCS_ASSETS)/"; \
	  (cd "$(DATA_DOCS_ASSETS)" && npm ci --loglevel=error); \
	  cp plugins/photon/tools/data_docs/package-lock.json "$(DATA_DOCS_ASSETS)/.installed-lock.json"

# Debian's Chromium: tests open the Data Docs in it headless, with the network off.
chromium:
	@if [ -x /usr/bin/chromium ]; then :; \
	elif [ "$$(id -u)" = 0 ]; then echo "== installing chromium (apt)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; \
	else echo "make setup: /usr/bin/chromium is missing; the Data Docs test needs it:" \
	  "sudo apt-get install -y --no-install-recommends chromium"; fi

# Debian's faketime: the clock tests run real `photon join` processes on a host clock that is off.
faketime:
	@if [ -x /usr/bin/faketime ]; then :; \
	elif [ "$$(id -u)" = 0 ]; then echo "== installing faketime (apt)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends faketime; \
	else echo "make setup: /usr/bin/faketime is missing; the clock tests need it: sudo apt-get install -y faketime"; fi

# Debian's etcd: the store Patroni keeps the leader key in, for the local three-node registry cluster
# (photon registry cluster up).
etcd:
	@if [ -x /usr/bin/etcd ]; then :; \
	elif [ "$$(id -u)" = 0 ]; then echo "== installing etcd-server (apt)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends etcd-server; \
	else echo "make setup: /usr/bin/etcd is missing; the registry cluster needs it:" \
	  "sudo apt-get install -y --no-install-recommends etcd-server"; fi

# The path already holds the requirements' hash, so a fresh clone (newer file times) must not rebuild it: the
# requirements file is an order-only prerequisite.
$(VENV)/.ready: | requirements.txt
	@echo "== creating virtual environment $(VENV)"
	rm -rf "$(VENV)"
	mkdir -p "$(VENV_ROOT)"
	$(PYTHON) -m venv "$(VENV)"
	"$(VENV)/bin/pip" install --quiet --upgrade pip
	"$(VENV)/bin/pip" install --quiet -r requirements.txt
	"$(VENV)/bin/pip" check
	touch "$@"

lint: setup
	"$(VENV)/bin/ruff" check plugins tests bench dags spark
	"$(VENV)/bin/ruff" format --check plugins tests bench dags spark
	"$(VENV)/bin/mypy"

# Three pytest workers (pytest-xdist) on this 2-core machine: most of a test's time is spent waiting (for a joiner
# subprocess, a Spark start, Airflow's scheduler, fsync), and with two workers the cores were idle about two thirds
# of the time (18.6 minutes in a fresh clone). Three: 15.3 minutes; four were no faster (15.4) and loaded the machine
# so that a timing-sensitive test failed now and then. Each worker starts its own embedded PostgreSQL (without PHOTON_REGISTRY_DSN), Spark session and Airflow
# home; conftest.py deals the long tests first. TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 3
test: setup lint
	"$(PY)" -m pytest -n $(TEST_WORKERS) --dist load --maxschedchunk 1 -m "not long" $(PYTEST_ARGS)

# The tests marked long: a lease through the DAG on a Spark standalone cluster, 2-5 minutes on this machine. Left out
# of `make test`, which must stay within CI's 20 minutes on 2 cores (the cluster test over a bucket runs there).
test-long: setup
	"$(PY)" -m pytest -m long $(PYTEST_ARGS)

# The parser's property tests (tests/unit/test_parse_properties.py) far past the suite's examples (3,000 a property,
# fewer for some): random (not derandomized), FUZZ_EXAMPLES per property (at most 100,000 for a single function's and
# 2,000 for lines of a megabyte). A failure prints the smallest example found and the @reproduce_failure line that
# replays it.
FUZZ_EXAMPLES ?= 500000
fuzz: setup
	HYPOTHESIS_PROFILE=fuzz FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) "$(PY)" -m pytest -p no:cacheprovider --timeout=0 \
	  tests/unit/test_parse_properties.py $(PYTEST_ARGS)

# A shell with the venv active: `photon`, `airflow`, `spark-submit` on PATH. Always bash, on an rc file of its own
# written here each time: it sources ~/.bashrc (aliases and functions stay), then puts the venv first on PATH and sets
# SPARK_HOME to the venv's pyspark, so a ~/.bashrc that puts another Python first no longer makes spark-submit stop
# with "Could not find valid SPARK_HOME" (its launcher asks `python3` where pyspark is unless SPARK_HOME is set). A
# prompt hook of the user's that moves PATH at each prompt (pyenv's, conda's) runs first; the venv goes first again after.
SHELL_RC := $(CURDIR)/.photon/make-shell.bashrc
shell: setup
	@set -e; mkdir -p "$(dir $(SHELL_RC))"; \
	  spark_home="$$("$(PY)" -c 'import os, pyspark; print(os.path.dirname(pyspark.__file__))')"; \
	  { echo '# Written by `make shell` each time it starts: ~/.bashrc first, then the venv wins.'; \
	    echo '[ -f ~/.bashrc ] && . ~/.bashrc'; \
	    echo 'export VIRTUAL_ENV="$(VENV)" SPARK_HOME="'"$$spark_home"'" PYTHONPATH="$(PYTHONPATH)"'; \
	    echo 'export PATH="$(VENV)/bin:$$PATH"'; \
	    echo '_photon_venv_first() { case ":$$PATH:" in ":$(VENV)/bin:"*) ;; *) PATH="$(VENV)/bin:$$PATH"; hash -r;; esac; }'; \
	    echo 'PROMPT_COMMAND="$${PROMPT_COMMAND:+$$PROMPT_COMMAND;}_photon_venv_first"'; \
	    echo 'hash -r'; \
	    echo 'PS1="(photon) $${PS1-\\$$ }"'; } > "$(SHELL_RC).tmp"; \
	  mv "$(SHELL_RC).tmp" "$(SHELL_RC)"; \
	  echo "photon venv: $(VENV); SPARK_HOME $$spark_home; rc file $(SHELL_RC) (exit to leave)"; \
	  exec /bin/bash --rcfile "$(SHELL_RC)" -i

demo: setup
	"$(PY)" -m photon demo

# Airflow with the project's DAGs (api-server on 127.0.0.1:8080, scheduler, DAG processor, triggerer; LocalExecutor,
# metadata on PostgreSQL) on the embedded defaults or PHOTON_REGISTRY_DSN; Ctrl-C or SIGTERM stops all of it.
# Options: AIRFLOW_ARGS="--port 8090 --host 0.0.0.0 --parallelism 12".
airflow: setup
	"$(PY)" -m photon airflow $(AIRFLOW_ARGS)

# The registry's write paths on one server, then "batched new" side by side with a fresh three-node cluster in a
# temporary folder (about 1-2 minutes; BENCH_ARGS="--no-replicated" skips the cluster, "--runs 3" fewer runs).
bench-registry: setup
	"$(PY)" -m bench.registry $(BENCH_ARGS)

# Re-resolve requirements.in into the fully pinned requirements.txt.
lock:
	rm -rf .lock-venv && $(PYTHON) -m venv .lock-venv
	.lock-venv/bin/pip install --quiet -r requirements.in && .lock-venv/bin/pip check
	(echo "# Generated by 'make lock' from requirements.in: every package pinned. Do not edit by hand."; \
	 .lock-venv/bin/pip freeze --exclude-editable) > requirements.txt
	rm -rf .lock-venv

# Stops nothing; removes the local state folder (embedded PostgreSQL data, demo logs and output).
clean-state:
	rm -rf .photon

bench-generator: setup
	"$(PY)" -m bench.generator $(BENCH_ARGS)

bench-pipeline: setup
	"$(PY)" -m bench.pipeline $(BENCH_ARGS)

# parse_file against bare pyarrow.json on the same lines: four shapes of generator output in 20,000-line files, 7
# alternating runs (about 1 minute; BENCH_ARGS="--runs 3 --shapes clicks" for less).
bench-parse: setup
	"$(PY)" -m bench.parse $(BENCH_ARGS)

# 1,200 1-s batches (20 minutes' worth) into one pipeline's tables, then `photon table maintain`: commits, files,
# files on disk, log files after the checkpoint and read time before and after, and the time maintenance takes (2-4
# minutes; BENCH_ARGS="--commits 3600" for an hour's worth, about 11 minutes). Last line: JSON.
bench-table: setup
	"$(PY)" -m bench.table_maintenance $(BENCH_ARGS)

# Trigger and lease-start cost at 20 k, 200 k and 2 M files seen (about 10 minutes; removes what it made).
bench-object-store: setup
	"$(PY)" -m bench.object_store $(BENCH_ARGS)

bench-discovery: setup
	"$(PY)" -m bench.discovery $(BENCH_ARGS)

# One data-quality check by phase (input, output, GX validation, Data Docs, localize): 10,000 and 100,000 clicks in an
# hour, output in 1-s batch files or one file, a fresh site or a month of history, idle and with 2 busy processes
# (about 30 minutes; BENCH_ARGS="--clicks 10000 --runs 3" for less).
bench-quality: setup
	"$(PY)" -m bench.quality $(BENCH_ARGS)

# Lease hand-over gaps and click latency: standby leases, sequential leases, one process (about 10 minutes).
bench-handover: setup
	"$(PY)" -m bench.handover $(BENCH_ARGS)

# The same through Airflow with a running scheduler: `photon airflow` in a temporary home, the two dc-a join DAGs with
# 60 s leases (PHOTON_JOIN_LEASE_S) over 300 s of live logs, then one long process on the same logs (about 15 minutes).
bench-handover-airflow: setup
	"$(PY)" -m bench.handover_airflow $(BENCH_ARGS)

# The nemesis: live logs, seeded random faults (joiner SIGKILLs, the registry stopped hard, verify beside the joiners,
# a replica outage, a data center lost for good), then a checker that reads files only. Last line: JSON.
# Its temporary folder is removed once the run passed (CHAOS_ARGS="--keep" keeps it; a failed run's stays).
# CHAOS_ARGS="--registry cluster": the registry on the local three-node Patroni cluster instead, its primary lost
# (SIGKILL, a standby promoted) and the old one rejoining where the single server would be stopped hard.
# CHAOS_ARGS="--storage s3": logs, output tables and state in a bucket of a local S3 server, which is SIGKILLed and
# started again (store_restart; some outages past the requests' retry budget).
# CHAOS_ARGS="--storage s3 --spark cluster": and every lease on a local Spark standalone cluster (a master, two
# workers in folders of their own), a worker SIGKILLed with its executors and started again (worker_kill).
SEED ?= 1
SECONDS ?= 300
chaos: setup
	"$(PY)" -m tests.nemesis.run --seed $(SEED) --seconds $(SECONDS) $(CHAOS_ARGS)
