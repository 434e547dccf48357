#!/usr/bin/env bash
# Moves tests/ into the layout of docs/design.md "Tests" (issue 36, item 5), on the merged tree, in one go:
#   tests/unit/<package>/  tests/conformance/  tests/harness/  (tests/peers/, tests/fixtures/ and the shared
#   conftest.py, paths.py, s3server.py, delay_proxy.py stay where they are).
# Then rewrites what names a moved file: relative imports become absolute (`from .test_cli import` ->
# `from tests.unit.top.test_cli import`), `python -m tests.X` / `tests.X` module names, and `tests/X.py`
# paths in code and docs. Paths from __file__ already go through tests/paths.py.
# Run from the repository root, on a clean work tree:  bash tools/arrange_tests.sh
# Check after:  pytest --collect-only -q  (the same count as before)  and  lint-imports.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
test -f tests/paths.py || { echo "tests/paths.py missing: run on the merged tree" >&2; exit 1; }
test ! -e tests/harness || { echo "tests/harness exists already: arranged?" >&2; exit 1; }
mv_() { if [ -e "tests/$1" ]; then git mv "tests/$1" "tests/$2"; else echo "arrange_tests: tests/$1 absent, skipped" >&2; fi; }
edit() { # edit PATTERN SED-EXPRESSION: apply the sed to every tracked text file that matches
  { git grep -lzE "$1" -- . ':!tests/fixtures' ':!tools/arrange_tests.sh' || true; } | xargs -0 -r sed -i -E "$2"
}

# 1. the folders, each a package (test modules import each other by absolute names)
mkdir -p tests/conformance && printf '' > tests/conformance/__init__.py && git add tests/conformance/__init__.py
mkdir -p tests/harness && printf '' > tests/harness/__init__.py && git add tests/harness/__init__.py
mkdir -p tests/unit && printf '' > tests/unit/__init__.py && git add tests/unit/__init__.py
mkdir -p tests/unit/adapters && printf '' > tests/unit/adapters/__init__.py && git add tests/unit/adapters/__init__.py
mkdir -p tests/unit/backends && printf '' > tests/unit/backends/__init__.py && git add tests/unit/backends/__init__.py
mkdir -p tests/unit/core && printf '' > tests/unit/core/__init__.py && git add tests/unit/core/__init__.py
mkdir -p tests/unit/home && printf '' > tests/unit/home/__init__.py && git add tests/unit/home/__init__.py
mkdir -p tests/unit/dcp && printf '' > tests/unit/dcp/__init__.py && git add tests/unit/dcp/__init__.py
mkdir -p tests/unit/objects && printf '' > tests/unit/objects/__init__.py && git add tests/unit/objects/__init__.py
mkdir -p tests/unit/protocols && printf '' > tests/unit/protocols/__init__.py && git add tests/unit/protocols/__init__.py
mkdir -p tests/unit/top && printf '' > tests/unit/top/__init__.py && git add tests/unit/top/__init__.py

# 2. the moves
mv_ test_jsonvalue.py unit/core/test_jsonvalue.py
mv_ test_packindex.py unit/objects/test_packindex.py
mv_ test_backends.py unit/backends/test_backends.py
mv_ backend_workers.py unit/backends/backend_workers.py
mv_ test_catalog.py unit/home/test_catalog.py
mv_ test_bucket_store.py unit/home/test_bucket_store.py
mv_ bucket_workers.py unit/home/bucket_workers.py
mv_ test_bucket_break.py unit/home/test_bucket_break.py
mv_ test_bucket_trust.py unit/home/test_bucket_trust.py
mv_ test_hostile_folder.py unit/home/test_hostile_folder.py
mv_ test_migration_kill.py unit/home/test_migration_kill.py
mv_ test_shared_rows.py unit/home/test_shared_rows.py
mv_ test_fencing.py unit/home/test_fencing.py
mv_ test_gc.py unit/protocols/test_gc.py
mv_ test_consolidation.py unit/protocols/test_consolidation.py
mv_ test_container.py unit/protocols/test_container.py
mv_ test_hardening_container.py unit/protocols/test_hardening_container.py
mv_ test_transfer.py unit/protocols/test_transfer.py
mv_ test_remote.py unit/protocols/test_remote.py
mv_ test_torchrl_import.py unit/protocols/test_torchrl_import.py
mv_ test_bad_blobs.py unit/protocols/test_bad_blobs.py
mv_ test_fingerprints.py unit/protocols/test_fingerprints.py
mv_ test_concurrent_writes.py unit/protocols/test_concurrent_writes.py
mv_ test_full_disk.py unit/protocols/test_full_disk.py
mv_ test_faults.py unit/protocols/test_faults.py
mv_ test_dcp.py unit/dcp/test_dcp.py
mv_ test_dcp_bucket.py unit/dcp/test_dcp_bucket.py
mv_ test_dcp_nodes.py unit/dcp/test_dcp_nodes.py
mv_ test_training.py unit/top/test_training.py
mv_ test_adapters.py unit/adapters/test_adapters.py
mv_ test_values.py unit/adapters/test_values.py
mv_ test_rng.py unit/adapters/test_rng.py
mv_ test_write_log.py unit/adapters/test_write_log.py
mv_ test_replay_buffer.py unit/adapters/test_replay_buffer.py
mv_ test_store.py unit/top/test_store.py
mv_ test_checkpointer.py unit/top/test_checkpointer.py
mv_ test_cli.py unit/top/test_cli.py
mv_ test_demo.py unit/top/test_demo.py
mv_ test_runs.py unit/top/test_runs.py
mv_ test_tiers_time.py unit/top/test_tiers_time.py
mv_ test_scale.py unit/top/test_scale.py
mv_ test_process_safety.py unit/top/test_process_safety.py
mv_ test_roundtrip.py unit/top/test_roundtrip.py
mv_ test_exact_state.py unit/top/test_exact_state.py
mv_ test_bad_input.py unit/top/test_bad_input.py
mv_ test_hardening.py unit/top/test_hardening.py
mv_ test_docs.py unit/top/test_docs.py
mv_ test_layers.py unit/top/test_layers.py
mv_ test_benchmarks_smoke.py unit/top/test_benchmarks_smoke.py
mv_ test_conformance.py conformance/test_conformance.py
mv_ harness_base.py harness/base.py
mv_ test_interfaces.py unit/home/test_interfaces.py
mv_ test_gc_marks.py unit/protocols/test_gc_marks.py
mv_ test_entry_writer.py unit/objects/test_entry_writer.py
mv_ test_archgraph.py unit/top/test_archgraph.py
mv_ clock.py harness/clock.py
mv_ stress.py harness/stress.py
mv_ test_stress.py harness/test_stress.py
mv_ bucket_stress.py harness/bucket_stress.py
mv_ test_bucket_stress.py harness/test_bucket_stress.py
mv_ procharness.py harness/procharness.py
mv_ test_procharness.py harness/test_procharness.py
mv_ nemesis.py harness/nemesis.py
mv_ test_nemesis.py harness/test_nemesis.py

# 3. imports and names of what moved (absolute from here on)
edit 'from \.{1,2}test_jsonvalue import' 's/from \.{1,2}test_jsonvalue import/from tests.unit.core.test_jsonvalue import/g'
edit '\btests\.test_jsonvalue\b' 's/\btests\.test_jsonvalue\b/tests.unit.core.test_jsonvalue/g'
edit '\btests/test_jsonvalue\.py' 's#\btests/test_jsonvalue\.py#tests/unit/core/test_jsonvalue.py#g'
edit 'from \.{1,2}test_packindex import' 's/from \.{1,2}test_packindex import/from tests.unit.objects.test_packindex import/g'
edit '\btests\.test_packindex\b' 's/\btests\.test_packindex\b/tests.unit.objects.test_packindex/g'
edit '\btests/test_packindex\.py' 's#\btests/test_packindex\.py#tests/unit/objects/test_packindex.py#g'
edit 'from \.{1,2}test_backends import' 's/from \.{1,2}test_backends import/from tests.unit.backends.test_backends import/g'
edit '\btests\.test_backends\b' 's/\btests\.test_backends\b/tests.unit.backends.test_backends/g'
edit '\btests/test_backends\.py' 's#\btests/test_backends\.py#tests/unit/backends/test_backends.py#g'
edit 'from \.{1,2}backend_workers import' 's/from \.{1,2}backend_workers import/from tests.unit.backends.backend_workers import/g'
edit 'from (\.|tests) import backend_workers\b' 's/from (\.|tests) import backend_workers\b/from tests.unit.backends import backend_workers/g'
edit '\btests\.backend_workers\b' 's/\btests\.backend_workers\b/tests.unit.backends.backend_workers/g'
edit '\btests/backend_workers\.py' 's#\btests/backend_workers\.py#tests/unit/backends/backend_workers.py#g'
edit 'from \.{1,2}test_catalog import' 's/from \.{1,2}test_catalog import/from tests.unit.home.test_catalog import/g'
edit '\btests\.test_catalog\b' 's/\btests\.test_catalog\b/tests.unit.home.test_catalog/g'
edit '\btests/test_catalog\.py' 's#\btests/test_catalog\.py#tests/unit/home/test_catalog.py#g'
edit 'from \.{1,2}test_bucket_store import' 's/from \.{1,2}test_bucket_store import/from tests.unit.home.test_bucket_store import/g'
edit '\btests\.test_bucket_store\b' 's/\btests\.test_bucket_store\b/tests.unit.home.test_bucket_store/g'
edit '\btests/test_bucket_store\.py' 's#\btests/test_bucket_store\.py#tests/unit/home/test_bucket_store.py#g'
edit 'from \.{1,2}bucket_workers import' 's/from \.{1,2}bucket_workers import/from tests.unit.home.bucket_workers import/g'
edit 'from (\.|tests) import bucket_workers\b' 's/from (\.|tests) import bucket_workers\b/from tests.unit.home import bucket_workers/g'
edit '\btests\.bucket_workers\b' 's/\btests\.bucket_workers\b/tests.unit.home.bucket_workers/g'
edit '\btests/bucket_workers\.py' 's#\btests/bucket_workers\.py#tests/unit/home/bucket_workers.py#g'
edit 'from \.{1,2}test_bucket_break import' 's/from \.{1,2}test_bucket_break import/from tests.unit.home.test_bucket_break import/g'
edit '\btests\.test_bucket_break\b' 's/\btests\.test_bucket_break\b/tests.unit.home.test_bucket_break/g'
edit '\btests/test_bucket_break\.py' 's#\btests/test_bucket_break\.py#tests/unit/home/test_bucket_break.py#g'
edit 'from \.{1,2}test_bucket_trust import' 's/from \.{1,2}test_bucket_trust import/from tests.unit.home.test_bucket_trust import/g'
edit '\btests\.test_bucket_trust\b' 's/\btests\.test_bucket_trust\b/tests.unit.home.test_bucket_trust/g'
edit '\btests/test_bucket_trust\.py' 's#\btests/test_bucket_trust\.py#tests/unit/home/test_bucket_trust.py#g'
edit 'from \.{1,2}test_hostile_folder import' 's/from \.{1,2}test_hostile_folder import/from tests.unit.home.test_hostile_folder import/g'
edit '\btests\.test_hostile_folder\b' 's/\btests\.test_hostile_folder\b/tests.unit.home.test_hostile_folder/g'
edit '\btests/test_hostile_folder\.py' 's#\btests/test_hostile_folder\.py#tests/unit/home/test_hostile_folder.py#g'
edit 'from \.{1,2}test_migration_kill import' 's/from \.{1,2}test_migration_kill import/from tests.unit.home.test_migration_kill import/g'
edit '\btests\.test_migration_kill\b' 's/\btests\.test_migration_kill\b/tests.unit.home.test_migration_kill/g'
edit '\btests/test_migration_kill\.py' 's#\btests/test_migration_kill\.py#tests/unit/home/test_migration_kill.py#g'
edit 'from \.{1,2}test_shared_rows import' 's/from \.{1,2}test_shared_rows import/from tests.unit.home.test_shared_rows import/g'
edit '\btests\.test_shared_rows\b' 's/\btests\.test_shared_rows\b/tests.unit.home.test_shared_rows/g'
edit '\btests/test_shared_rows\.py' 's#\btests/test_shared_rows\.py#tests/unit/home/test_shared_rows.py#g'
edit 'from \.{1,2}test_fencing import' 's/from \.{1,2}test_fencing import/from tests.unit.home.test_fencing import/g'
edit '\btests\.test_fencing\b' 's/\btests\.test_fencing\b/tests.unit.home.test_fencing/g'
edit '\btests/test_fencing\.py' 's#\btests/test_fencing\.py#tests/unit/home/test_fencing.py#g'
edit 'from \.{1,2}test_gc import' 's/from \.{1,2}test_gc import/from tests.unit.protocols.test_gc import/g'
edit '\btests\.test_gc\b' 's/\btests\.test_gc\b/tests.unit.protocols.test_gc/g'
edit '\btests/test_gc\.py' 's#\btests/test_gc\.py#tests/unit/protocols/test_gc.py#g'
edit 'from \.{1,2}test_consolidation import' 's/from \.{1,2}test_consolidation import/from tests.unit.protocols.test_consolidation import/g'
edit '\btests\.test_consolidation\b' 's/\btests\.test_consolidation\b/tests.unit.protocols.test_consolidation/g'
edit '\btests/test_consolidation\.py' 's#\btests/test_consolidation\.py#tests/unit/protocols/test_consolidation.py#g'
edit 'from \.{1,2}test_container import' 's/from \.{1,2}test_container import/from tests.unit.protocols.test_container import/g'
edit '\btests\.test_container\b' 's/\btests\.test_container\b/tests.unit.protocols.test_container/g'
edit '\btests/test_container\.py' 's#\btests/test_container\.py#tests/unit/protocols/test_container.py#g'
edit 'from \.{1,2}test_hardening_container import' 's/from \.{1,2}test_hardening_container import/from tests.unit.protocols.test_hardening_container import/g'
edit '\btests\.test_hardening_container\b' 's/\btests\.test_hardening_container\b/tests.unit.protocols.test_hardening_container/g'
edit '\btests/test_hardening_container\.py' 's#\btests/test_hardening_container\.py#tests/unit/protocols/test_hardening_container.py#g'
edit 'from \.{1,2}test_transfer import' 's/from \.{1,2}test_transfer import/from tests.unit.protocols.test_transfer import/g'
edit '\btests\.test_transfer\b' 's/\btests\.test_transfer\b/tests.unit.protocols.test_transfer/g'
edit '\btests/test_transfer\.py' 's#\btests/test_transfer\.py#tests/unit/protocols/test_transfer.py#g'
edit 'from \.{1,2}test_remote import' 's/from \.{1,2}test_remote import/from tests.unit.protocols.test_remote import/g'
edit '\btests\.test_remote\b' 's/\btests\.test_remote\b/tests.unit.protocols.test_remote/g'
edit '\btests/test_remote\.py' 's#\btests/test_remote\.py#tests/unit/protocols/test_remote.py#g'
edit 'from \.{1,2}test_torchrl_import import' 's/from \.{1,2}test_torchrl_import import/from tests.unit.protocols.test_torchrl_import import/g'
edit '\btests\.test_torchrl_import\b' 's/\btests\.test_torchrl_import\b/tests.unit.protocols.test_torchrl_import/g'
edit '\btests/test_torchrl_import\.py' 's#\btests/test_torchrl_import\.py#tests/unit/protocols/test_torchrl_import.py#g'
edit 'from \.{1,2}test_bad_blobs import' 's/from \.{1,2}test_bad_blobs import/from tests.unit.protocols.test_bad_blobs import/g'
edit '\btests\.test_bad_blobs\b' 's/\btests\.test_bad_blobs\b/tests.unit.protocols.test_bad_blobs/g'
edit '\btests/test_bad_blobs\.py' 's#\btests/test_bad_blobs\.py#tests/unit/protocols/test_bad_blobs.py#g'
edit 'from \.{1,2}test_fingerprints import' 's/from \.{1,2}test_fingerprints import/from tests.unit.protocols.test_fingerprints import/g'
edit '\btests\.test_fingerprints\b' 's/\btests\.test_fingerprints\b/tests.unit.protocols.test_fingerprints/g'
edit '\btests/test_fingerprints\.py' 's#\btests/test_fingerprints\.py#tests/unit/protocols/test_fingerprints.py#g'
edit 'from \.{1,2}test_concurrent_writes import' 's/from \.{1,2}test_concurrent_writes import/from tests.unit.protocols.test_concurrent_writes import/g'
edit '\btests\.test_concurrent_writes\b' 's/\btests\.test_concurrent_writes\b/tests.unit.protocols.test_concurrent_writes/g'
edit '\btests/test_concurrent_writes\.py' 's#\btests/test_concurrent_writes\.py#tests/unit/protocols/test_concurrent_writes.py#g'
edit 'from \.{1,2}test_full_disk import' 's/from \.{1,2}test_full_disk import/from tests.unit.protocols.test_full_disk import/g'
edit '\btests\.test_full_disk\b' 's/\btests\.test_full_disk\b/tests.unit.protocols.test_full_disk/g'
edit '\btests/test_full_disk\.py' 's#\btests/test_full_disk\.py#tests/unit/protocols/test_full_disk.py#g'
edit 'from \.{1,2}test_faults import' 's/from \.{1,2}test_faults import/from tests.unit.protocols.test_faults import/g'
edit '\btests\.test_faults\b' 's/\btests\.test_faults\b/tests.unit.protocols.test_faults/g'
edit '\btests/test_faults\.py' 's#\btests/test_faults\.py#tests/unit/protocols/test_faults.py#g'
edit 'from \.{1,2}test_dcp import' 's/from \.{1,2}test_dcp import/from tests.unit.dcp.test_dcp import/g'
edit '\btests\.test_dcp\b' 's/\btests\.test_dcp\b/tests.unit.dcp.test_dcp/g'
edit '\btests/test_dcp\.py' 's#\btests/test_dcp\.py#tests/unit/dcp/test_dcp.py#g'
edit 'from \.{1,2}test_dcp_bucket import' 's/from \.{1,2}test_dcp_bucket import/from tests.unit.dcp.test_dcp_bucket import/g'
edit '\btests\.test_dcp_bucket\b' 's/\btests\.test_dcp_bucket\b/tests.unit.dcp.test_dcp_bucket/g'
edit '\btests/test_dcp_bucket\.py' 's#\btests/test_dcp_bucket\.py#tests/unit/dcp/test_dcp_bucket.py#g'
edit 'from \.{1,2}test_dcp_nodes import' 's/from \.{1,2}test_dcp_nodes import/from tests.unit.dcp.test_dcp_nodes import/g'
edit '\btests\.test_dcp_nodes\b' 's/\btests\.test_dcp_nodes\b/tests.unit.dcp.test_dcp_nodes/g'
edit '\btests/test_dcp_nodes\.py' 's#\btests/test_dcp_nodes\.py#tests/unit/dcp/test_dcp_nodes.py#g'
edit 'from \.{1,2}test_training import' 's/from \.{1,2}test_training import/from tests.unit.top.test_training import/g'
edit '\btests\.test_training\b' 's/\btests\.test_training\b/tests.unit.top.test_training/g'
edit '\btests/test_training\.py' 's#\btests/test_training\.py#tests/unit/top/test_training.py#g'
edit 'from \.{1,2}test_adapters import' 's/from \.{1,2}test_adapters import/from tests.unit.adapters.test_adapters import/g'
edit '\btests\.test_adapters\b' 's/\btests\.test_adapters\b/tests.unit.adapters.test_adapters/g'
edit '\btests/test_adapters\.py' 's#\btests/test_adapters\.py#tests/unit/adapters/test_adapters.py#g'
edit 'from \.{1,2}test_values import' 's/from \.{1,2}test_values import/from tests.unit.adapters.test_values import/g'
edit '\btests\.test_values\b' 's/\btests\.test_values\b/tests.unit.adapters.test_values/g'
edit '\btests/test_values\.py' 's#\btests/test_values\.py#tests/unit/adapters/test_values.py#g'
edit 'from \.{1,2}test_rng import' 's/from \.{1,2}test_rng import/from tests.unit.adapters.test_rng import/g'
edit '\btests\.test_rng\b' 's/\btests\.test_rng\b/tests.unit.adapters.test_rng/g'
edit '\btests/test_rng\.py' 's#\btests/test_rng\.py#tests/unit/adapters/test_rng.py#g'
edit 'from \.{1,2}test_write_log import' 's/from \.{1,2}test_write_log import/from tests.unit.adapters.test_write_log import/g'
edit '\btests\.test_write_log\b' 's/\btests\.test_write_log\b/tests.unit.adapters.test_write_log/g'
edit '\btests/test_write_log\.py' 's#\btests/test_write_log\.py#tests/unit/adapters/test_write_log.py#g'
edit 'from \.{1,2}test_replay_buffer import' 's/from \.{1,2}test_replay_buffer import/from tests.unit.adapters.test_replay_buffer import/g'
edit '\btests\.test_replay_buffer\b' 's/\btests\.test_replay_buffer\b/tests.unit.adapters.test_replay_buffer/g'
edit '\btests/test_replay_buffer\.py' 's#\btests/test_replay_buffer\.py#tests/unit/adapters/test_replay_buffer.py#g'
edit 'from \.{1,2}test_store import' 's/from \.{1,2}test_store import/from tests.unit.top.test_store import/g'
edit '\btests\.test_store\b' 's/\btests\.test_store\b/tests.unit.top.test_store/g'
edit '\btests/test_store\.py' 's#\btests/test_store\.py#tests/unit/top/test_store.py#g'
edit 'from \.{1,2}test_checkpointer import' 's/from \.{1,2}test_checkpointer import/from tests.unit.top.test_checkpointer import/g'
edit '\btests\.test_checkpointer\b' 's/\btests\.test_checkpointer\b/tests.unit.top.test_checkpointer/g'
edit '\btests/test_checkpointer\.py' 's#\btests/test_checkpointer\.py#tests/unit/top/test_checkpointer.py#g'
edit 'from \.{1,2}test_cli import' 's/from \.{1,2}test_cli import/from tests.unit.top.test_cli import/g'
edit '\btests\.test_cli\b' 's/\btests\.test_cli\b/tests.unit.top.test_cli/g'
edit '\btests/test_cli\.py' 's#\btests/test_cli\.py#tests/unit/top/test_cli.py#g'
edit 'from \.{1,2}test_demo import' 's/from \.{1,2}test_demo import/from tests.unit.top.test_demo import/g'
edit '\btests\.test_demo\b' 's/\btests\.test_demo\b/tests.unit.top.test_demo/g'
edit '\btests/test_demo\.py' 's#\btests/test_demo\.py#tests/unit/top/test_demo.py#g'
edit 'from \.{1,2}test_runs import' 's/from \.{1,2}test_runs import/from tests.unit.top.test_runs import/g'
edit '\btests\.test_runs\b' 's/\btests\.test_runs\b/tests.unit.top.test_runs/g'
edit '\btests/test_runs\.py' 's#\btests/test_runs\.py#tests/unit/top/test_runs.py#g'
edit 'from \.{1,2}test_tiers_time import' 's/from \.{1,2}test_tiers_time import/from tests.unit.top.test_tiers_time import/g'
edit '\btests\.test_tiers_time\b' 's/\btests\.test_tiers_time\b/tests.unit.top.test_tiers_time/g'
edit '\btests/test_tiers_time\.py' 's#\btests/test_tiers_time\.py#tests/unit/top/test_tiers_time.py#g'
edit 'from \.{1,2}test_scale import' 's/from \.{1,2}test_scale import/from tests.unit.top.test_scale import/g'
edit '\btests\.test_scale\b' 's/\btests\.test_scale\b/tests.unit.top.test_scale/g'
edit '\btests/test_scale\.py' 's#\btests/test_scale\.py#tests/unit/top/test_scale.py#g'
edit 'from \.{1,2}test_process_safety import' 's/from \.{1,2}test_process_safety import/from tests.unit.top.test_process_safety import/g'
edit '\btests\.test_process_safety\b' 's/\btests\.test_process_safety\b/tests.unit.top.test_process_safety/g'
edit '\btests/test_process_safety\.py' 's#\btests/test_process_safety\.py#tests/unit/top/test_process_safety.py#g'
edit 'from \.{1,2}test_roundtrip import' 's/from \.{1,2}test_roundtrip import/from tests.unit.top.test_roundtrip import/g'
edit '\btests\.test_roundtrip\b' 's/\btests\.test_roundtrip\b/tests.unit.top.test_roundtrip/g'
edit '\btests/test_roundtrip\.py' 's#\btests/test_roundtrip\.py#tests/unit/top/test_roundtrip.py#g'
edit 'from \.{1,2}test_exact_state import' 's/from \.{1,2}test_exact_state import/from tests.unit.top.test_exact_state import/g'
edit '\btests\.test_exact_state\b' 's/\btests\.test_exact_state\b/tests.unit.top.test_exact_state/g'
edit '\btests/test_exact_state\.py' 's#\btests/test_exact_state\.py#tests/unit/top/test_exact_state.py#g'
edit 'from \.{1,2}test_bad_input import' 's/from \.{1,2}test_bad_input import/from tests.unit.top.test_bad_input import/g'
edit '\btests\.test_bad_input\b' 's/\btests\.test_bad_input\b/tests.unit.top.test_bad_input/g'
edit '\btests/test_bad_input\.py' 's#\btests/test_bad_input\.py#tests/unit/top/test_bad_input.py#g'
edit 'from \.{1,2}test_hardening import' 's/from \.{1,2}test_hardening import/from tests.unit.top.test_hardening import/g'
edit '\btests\.test_hardening\b' 's/\btests\.test_hardening\b/tests.unit.top.test_hardening/g'
edit '\btests/test_hardening\.py' 's#\btests/test_hardening\.py#tests/unit/top/test_hardening.py#g'
edit 'from \.{1,2}test_docs import' 's/from \.{1,2}test_docs import/from tests.unit.top.test_docs import/g'
edit '\btests\.test_docs\b' 's/\btests\.test_docs\b/tests.unit.top.test_docs/g'
edit '\btests/test_docs\.py' 's#\btests/test_docs\.py#tests/unit/top/test_docs.py#g'
edit 'from \.{1,2}test_layers import' 's/from \.{1,2}test_layers import/from tests.unit.top.test_layers import/g'
edit '\btests\.test_layers\b' 's/\btests\.test_layers\b/tests.unit.top.test_layers/g'
edit '\btests/test_layers\.py' 's#\btests/test_layers\.py#tests/unit/top/test_layers.py#g'
edit 'from \.{1,2}test_benchmarks_smoke import' 's/from \.{1,2}test_benchmarks_smoke import/from tests.unit.top.test_benchmarks_smoke import/g'
edit '\btests\.test_benchmarks_smoke\b' 's/\btests\.test_benchmarks_smoke\b/tests.unit.top.test_benchmarks_smoke/g'
edit '\btests/test_benchmarks_smoke\.py' 's#\btests/test_benchmarks_smoke\.py#tests/unit/top/test_benchmarks_smoke.py#g'
edit 'from \.{1,2}test_conformance import' 's/from \.{1,2}test_conformance import/from tests.conformance.test_conformance import/g'
edit '\btests\.test_conformance\b' 's/\btests\.test_conformance\b/tests.conformance.test_conformance/g'
edit '\btests/test_conformance\.py' 's#\btests/test_conformance\.py#tests/conformance/test_conformance.py#g'
edit 'from \.{1,2}harness_base import' 's/from \.{1,2}harness_base import/from tests.harness.base import/g'
edit '\btests\.harness_base\b' 's/\btests\.harness_base\b/tests.harness.base/g'
edit '\btests/harness_base\.py' 's#\btests/harness_base\.py#tests/harness/base.py#g'
edit 'from \.{1,2}stress import' 's/from \.{1,2}stress import/from tests.harness.stress import/g'
edit '\btests\.stress\b' 's/\btests\.stress\b/tests.harness.stress/g'
edit '\btests/stress\.py' 's#\btests/stress\.py#tests/harness/stress.py#g'
edit 'from \.{1,2}test_stress import' 's/from \.{1,2}test_stress import/from tests.harness.test_stress import/g'
edit '\btests\.test_stress\b' 's/\btests\.test_stress\b/tests.harness.test_stress/g'
edit '\btests/test_stress\.py' 's#\btests/test_stress\.py#tests/harness/test_stress.py#g'
edit 'from \.{1,2}bucket_stress import' 's/from \.{1,2}bucket_stress import/from tests.harness.bucket_stress import/g'
edit '\btests\.bucket_stress\b' 's/\btests\.bucket_stress\b/tests.harness.bucket_stress/g'
edit '\btests/bucket_stress\.py' 's#\btests/bucket_stress\.py#tests/harness/bucket_stress.py#g'
edit 'from \.{1,2}test_bucket_stress import' 's/from \.{1,2}test_bucket_stress import/from tests.harness.test_bucket_stress import/g'
edit '\btests\.test_bucket_stress\b' 's/\btests\.test_bucket_stress\b/tests.harness.test_bucket_stress/g'
edit '\btests/test_bucket_stress\.py' 's#\btests/test_bucket_stress\.py#tests/harness/test_bucket_stress.py#g'
edit 'from \.{1,2}procharness import' 's/from \.{1,2}procharness import/from tests.harness.procharness import/g'
edit '\btests\.procharness\b' 's/\btests\.procharness\b/tests.harness.procharness/g'
edit '\btests/procharness\.py' 's#\btests/procharness\.py#tests/harness/procharness.py#g'
edit 'from \.{1,2}test_procharness import' 's/from \.{1,2}test_procharness import/from tests.harness.test_procharness import/g'
edit '\btests\.test_procharness\b' 's/\btests\.test_procharness\b/tests.harness.test_procharness/g'
edit '\btests/test_procharness\.py' 's#\btests/test_procharness\.py#tests/harness/test_procharness.py#g'
edit 'from \.{1,2}nemesis import' 's/from \.{1,2}nemesis import/from tests.harness.nemesis import/g'
edit '\btests\.nemesis\b' 's/\btests\.nemesis\b/tests.harness.nemesis/g'
edit '\btests/nemesis\.py' 's#\btests/nemesis\.py#tests/harness/nemesis.py#g'
edit 'from \.{1,2}test_nemesis import' 's/from \.{1,2}test_nemesis import/from tests.harness.test_nemesis import/g'
edit '\btests\.test_nemesis\b' 's/\btests\.test_nemesis\b/tests.harness.test_nemesis/g'
edit '\btests/test_nemesis\.py' 's#\btests/test_nemesis\.py#tests/harness/test_nemesis.py#g'

edit 'from \.{1,2}clock import' 's/from \.{1,2}clock import/from tests.harness.clock import/g'
edit '\btests/clock\.py' 's#\btests/clock\.py#tests/harness/clock.py#g'

# 4. what stayed in tests/, imported from a moved file: absolute too
edit 'from \.conftest import' 's/from \.conftest import/from tests.conftest import/g'
edit 'from \.paths import' 's/from \.paths import/from tests.paths import/g'
edit 'from \.s3server import' 's/from \.s3server import/from tests.s3server import/g'
edit 'from \.delay_proxy import' 's/from \.delay_proxy import/from tests.delay_proxy import/g'

# 5. a test file nobody placed (added since this script was written) stays in tests/: say so
left=$(cd tests && ls test_*.py 2>/dev/null || true)
if [ -n "$left" ]; then echo "arrange_tests: left in tests/ (place them by hand, then fix their relative imports):" $left >&2; fi
echo "arrange_tests: done; now: pytest --collect-only -q"
