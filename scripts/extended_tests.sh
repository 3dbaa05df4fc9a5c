#!/usr/bin/env bash
# The extended cases (pytest marker `extended`): more layouts and backends of families the CI tier already
# covers, kept out of CI for its time budget. Run before landing a change to moe_kernels.parallel or
# moe_kernels.dispatch:  bash scripts/extended_tests.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
MOE_KERNELS_EXTENDED=1 exec python -m pytest -q -m extended -p no:cacheprovider "$@" tests
