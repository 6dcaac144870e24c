#!/usr/bin/env bash
# test_slurm.sh — tools/kvq-shards.slurm on a real Slurm: a one-node cluster
# (slurm-wlm and munge from Debian, as root; tools/setup.sh test installs
# them) started under the build directory without systemd, stopped by pid.
# The docs' commands are submitted verbatim from a checkout's root with
# nothing set: kvq-eval --chunk with more tasks than windows and a spec with
# spaces, kvq-alloc's passes, a kvq-sweep grid; each merge equals one run
# byte for byte.  A requeued task resumes its shard and appends to its log;
# a failed task cancels the merge; a second run in the same OUTDIR with
# another task count is refused.  Skips (exit 77) with one line when not root
# or when Slurm cannot start.
#   test_slurm.sh BUILD_DIR SOURCE_DIR
set -u
build=$(cd "$1" && pwd)
src=$(cd "$2" && pwd)
skip() { echo "SKIP: $*"; exit 77; }
[ "$(id -u)" = 0 ] || skip "not root (a test Slurm runs its daemons as root)"
for p in slurmctld slurmd munged sbatch scontrol squeue; do
    command -v $p >/dev/null || skip "$p not found (apt-get install slurm-wlm munge; tools/setup.sh test does as root)"
done

pass=0 fail=0
ok() { pass=$((pass + 1)); }
bad() { fail=$((fail + 1)); echo "FAIL: $*"; }

# --- a one-node cluster under the build directory (short paths: socket names have a limit)
run=$(mktemp -d /tmp/kvq-slurm.XXXXXX)
host=$(hostname -s)
port=$((20000 + $$ % 20000))
mkdir -p "$run/state" "$run/spool" "$run/munge"
stop() {
    for d in slurmd slurmctld munged; do
        [ -s "$run/$d.pid" ] && kill "$(cat "$run/$d.pid")" 2>/dev/null
    done
    sleep 0.5
    for d in slurmd slurmctld munged; do
        [ -s "$run/$d.pid" ] && kill -9 "$(cat "$run/$d.pid")" 2>/dev/null
    done
    [ "${KEEP_SLURM_LOGS:-}" ] || rm -rf "$run"
}
trap stop EXIT
cat >"$run/slurm.conf" <<EOF
ClusterName=kvqtest
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$run/munge/sock
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MinJobAge=600
StateSaveLocation=$run/state
SlurmdSpoolDir=$run/spool
SlurmctldPidFile=$run/slurmctld.pid
SlurmdPidFile=$run/slurmd.pid
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmctldLogFile=$run/slurmctld.log
SlurmdLogFile=$run/slurmd.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName=$host CPUs=$(nproc) State=UNKNOWN
PartitionName=test Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF=$run/slurm.conf
munged --force --socket="$run/munge/sock" --pid-file="$run/munged.pid" --log-file="$run/munged.log" \
    --seed-file="$run/munge/seed" 2>"$run/munged.err" || skip "munged cannot start: $(head -n 1 "$run/munged.err")"
slurmctld -i 2>"$run/slurmctld.err" || skip "slurmctld cannot start: $(head -n 1 "$run/slurmctld.err")"
slurmd 2>"$run/slurmd.err" || skip "slurmd cannot start: $(head -n 1 "$run/slurmd.err")"
t0=$SECONDS
until sinfo -h -o %t 2>/dev/null | grep -Eq '^(idle|mix|alloc)'; do
    [ $((SECONDS - t0)) -lt 30 ] || skip "the test Slurm's node did not come up in 30 s: $(sinfo -h -o '%t %E' 2>&1 | head -n 1)"
    sleep 0.5
done
echo "slurm: one node ($(nproc) CPUs) up in $((SECONDS - t0)) s"

wait_jobs() { # job ids...: until none is pending or running (300 s at most)
    local t=$SECONDS
    while squeue -h -j "$(
        IFS=,
        echo "$*"
    )" -o %i 2>/dev/null | grep -q .; do
        [ $((SECONDS - t)) -lt 300 ] || { echo "timeout waiting for jobs $*"; squeue; return 1; }
        sleep 1
    done
}
job_state() { scontrol show job "$1" 2>/dev/null | sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p' | head -n 1; }

# --- a checkout's root: the repository's data and a build at build/ (the one under test)
root=$run/checkout
mkdir -p "$root"
ln -s "$src/data" "$root/data"
ln -s "$src/tools" "$root/tools"
ln -s "$build" "$root/build"
cd "$root"
unset KVQ_BIN OUTDIR
m=data/kvq-retrieval.gguf t=data/retrieval-main.txt
spec='tokens(snapkv:keep=0.25; none; drop)'

# kvq-eval: 8 tasks over 7 windows (task 0 empty), a spec with spaces; the docs' two commands
"$build/tools/kvq-eval" $m --text $t --chunk 64 --chunks 7 -q none -q "$spec" -q kivi:bits=2 --progress never \
    -o one-eval.csv 2>/dev/null
t1=$SECONDS
jid=$(sbatch --parsable --array=0-7 tools/kvq-shards.slurm kvq-eval $m --text $t --chunk 64 --chunks 7 -q none \
    -q "$spec" -q kivi:bits=2)
mid=$(sbatch --parsable --dependency=afterok:$jid tools/kvq-shards.slurm merge kvq-eval)
wait_jobs "$jid" "$mid"
echo "slurm: kvq-eval array of 8 and its merge in $((SECONDS - t1)) s"
cmp -s one-eval.csv kvq-out/eval.csv && ok || bad "kvq-eval: the Slurm merge differs from one run ($(job_state "$mid"); $(tail -n 2 kvq-shards-"$mid".log 2>&1); the tasks' errors: $(grep -h -i "error\|killed\|cancel" kvq-shards-*.log 2>&1 | head -n 3))"
[ -e "kvq-shards-$mid.log" ] && grep -q "merged 7 windows of 3 configurations from 8 shards" "kvq-shards-$mid.log" &&
    ok || bad "the merge's log kvq-shards-$mid.log: $(cat "kvq-shards-$mid.log" 2>&1 | head -n 3)"
ls kvq-shards-*4294967294* >/dev/null 2>&1 && bad "a log named after no task" || ok

# a requeued task resumes its shard (here cut inside its window) and appends to its log
tid=$(squeue -h -t all -j "$jid" -o '%i %A' 2>/dev/null | awk '$1 ~ /_3$/ {print $2}')
[ -z "$tid" ] && tid=$(scontrol show job "${jid}_3" 2>/dev/null | sed -n 's/^JobId=\([0-9]*\).*/\1/p' | head -n 1)
cp kvq-out/shard-3-of-8.csv whole3.csv
head -c "$(($(head -n 1 whole3.csv | wc -c) + 40))" whole3.csv >kvq-out/shard-3-of-8.csv
if scontrol requeue "$tid" 2>"$run/requeue.err"; then
    scontrol update JobId="$tid" StartTime=now 2>/dev/null # Slurm holds a requeued job back for about two minutes
    wait_jobs "$tid"
    cmp -s whole3.csv kvq-out/shard-3-of-8.csv && ok || bad "a requeued task's shard differs: $(tail -n 3 "kvq-shards-$tid.log")"
    [ "$(grep -c "task 3 of 8" "kvq-shards-$tid.log")" = 2 ] && ok || bad "the requeued task's log was not appended to"
else
    bad "scontrol requeue $tid: $(head -n 1 "$run/requeue.err")"
fi

# the same OUTDIR with another task count: the task is refused and its merge cancelled, not left waiting
jid2=$(sbatch --parsable --array=0-1 tools/kvq-shards.slurm kvq-eval $m --text $t --chunk 64 --chunks 7 -q none)
mid2=$(sbatch --parsable --dependency=afterok:$jid2 tools/kvq-shards.slurm merge kvq-eval)
wait_jobs "$jid2" "$mid2"
grep -q "a shard of a run in 8 tasks; this array has 2" kvq-shards-*.log && ok || bad "OUTDIR reuse with another task count was not refused"
[ "$(job_state "$mid2")" = CANCELLED ] && ok || bad "the merge after a failed task is $(job_state "$mid2"), not CANCELLED"
cmp -s one-eval.csv kvq-out/eval.csv && ok || bad "a refused run changed kvq-out/eval.csv"

# kvq-alloc: the passes over 3 tasks, the merge allocates as one run
aargs=($m --text $t --max-tokens 192 --family kivi --grid kbits=2,4 --grid vbits=2,4 --fixed residual=0 --budget 3,4)
"$build/tools/kvq-alloc" "${aargs[@]}" --progress never -o one-alloc.csv 2>/dev/null
jid=$(OUTDIR=alloc-out sbatch --parsable --array=0-2 tools/kvq-shards.slurm kvq-alloc "${aargs[@]}")
mid=$(OUTDIR=alloc-out sbatch --parsable --dependency=afterok:$jid tools/kvq-shards.slurm merge kvq-alloc "${aargs[@]}")
wait_jobs "$jid" "$mid"
cmp -s one-alloc.csv alloc-out/alloc.csv && ok || bad "kvq-alloc: the Slurm merge differs from one run: $(tail -n 2 "kvq-shards-$mid.log")"

# kvq-sweep: a grid over 3 tasks, dumps given as a glob (expanded when submitting), the grid proved complete
sargs=(--quant kivi --grid group=32,64 --grid bits=2,4 --layers 0)
"$build/tools/kvq-sweep" data/kvq-retrieval*.h5 "${sargs[@]}" --progress never -o one-sweep.csv 2>/dev/null
jid=$(OUTDIR=sweep-out sbatch --parsable --array=0-2 tools/kvq-shards.slurm kvq-sweep data/kvq-retrieval*.h5 "${sargs[@]}")
mid=$(OUTDIR=sweep-out sbatch --parsable --dependency=afterok:$jid tools/kvq-shards.slurm merge kvq-sweep data/kvq-retrieval*.h5 "${sargs[@]}")
wait_jobs "$jid" "$mid"
cmp -s one-sweep.csv sweep-out/sweep.csv && ok || bad "kvq-sweep: the Slurm merge differs from one run: $(tail -n 2 "kvq-shards-$mid.log")"
grep -q "the grid is complete" "kvq-shards-$mid.log" && ok || bad "kvq-sweep's merge did not prove the grid"

echo "slurm: $pass passed, $fail failed ($((SECONDS - t0)) s)"
[ $fail = 0 ]
