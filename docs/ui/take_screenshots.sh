#!/usr/bin/env bash
# Re-take the Prefect UI screenshots (README, docs/deployment.md): the main job (`tidal run main`, 12 steps) into a
# scratch PREFECT_HOME, a Prefect server with its UI on that home, then headless Chromium on four
# pages. The step timeline is of the first step that took the hybrids back and lent them again, so
# it shows every phase: should_deactivate, wait_for_samples, train, broadcast_sync,
# should_activate, hybrid_sync, activate, update_after_step, commit.
# Needs `chromium` (Debian: apt-get install chromium). Usage: docs/ui/take_screenshots.sh [PORT]
set -euo pipefail
cd "$(dirname "$0")/../.."
port=${1:-4399}
work=$(mktemp -d /tmp/tidal-shots-XXXX)
export PREFECT_HOME=$work/home PREFECT_SERVER_ANALYTICS_ENABLED=false
.venv/bin/tidal run main --set trainer.total_training_steps=12 --set storage.url=sqlite:///$work/tidal.db \
  --set trainer.default_local_dir=$work/runs --set ray.temp_dir=$work/ray | tee docs/ui/terminal.txt
PREFECT_SERVER_API_PORT=$port PREFECT_UI_API_URL=http://127.0.0.1:$port/api \
  setsid .venv/bin/prefect server start --host 127.0.0.1 --port "$port" --no-scheduler > "$work/ui.log" 2>&1 &
server=$!
trap 'kill -- -$server 2>/dev/null || true; rm -rf "$work"' EXIT
until curl -sf "127.0.0.1:$port/api/health" > /dev/null; do sleep 2; done
api() { curl -sf -X POST "127.0.0.1:$port/api/$1" -H 'content-type: application/json' -d "$2"; }
pick() { python3 -c "import json, sys; $1"; }
run=$(api flow_runs/filter '{"flows":{"name":{"any_":["training-run"]}}}' | pick 'print(json.load(sys.stdin)[0]["id"])')
# the flow runs (steps) with a task run of each name; the first step that has both
steps_with() { api task_runs/filter "{\"task_runs\":{\"name\":{\"like_\":\"$1\"}},\"limit\":200}" \
  | pick 'print(" ".join(sorted({r["flow_run_id"] for r in json.load(sys.stdin)})))'; }
both=$(comm -12 <(steps_with wait_for_samples | tr ' ' '\n' | sort) <(steps_with activate | tr ' ' '\n' | sort))
step=$(api flow_runs/filter '{"flows":{"name":{"any_":["training-step"]}},"sort":"NAME_ASC"}' \
  | BOTH="$both" pick 'import os; ids = set(os.environ["BOTH"].split()); print(next(r["id"] for r in json.load(sys.stdin) if r["id"] in ids))')
latest=$(api artifacts/latest/filter '{}')
table=$(echo "$latest" | pick 'print(next(r["latest_id"] for r in json.load(sys.stdin) if r["key"].endswith("-steps")))')
markdown=$(echo "$latest" | pick 'print(next(r["latest_id"] for r in json.load(sys.stdin) if r["key"].endswith("-step")))')
shot() {
  chromium --headless=new --no-sandbox --disable-gpu --hide-scrollbars --window-size=1500,950 \
    --virtual-time-budget=25000 --screenshot="docs/ui/$1" "http://127.0.0.1:$port/$2" > /dev/null 2>&1
}
shot run-timeline.png "runs/flow-run/$run"
shot step-timeline.png "runs/flow-run/$step"
shot step-table.png "artifacts/artifact/$table"
shot step-artifact.png "artifacts/artifact/$markdown"
