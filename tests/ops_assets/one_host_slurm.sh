#!/bin/bash
# A real Slurm on this one host for tests/ops_assets/slurm.rs: one slurmctld and N slurmd
# (n1..nN) from Debian's packages, every daemon on loopback, state and logs under DIR.
#
#   one_host_slurm.sh start DIR N PORT_BASE   # writes DIR/slurm.conf, starts munged (if needed) and the daemons
#   one_host_slurm.sh stop DIR                # stops the daemons it started (their pid files)
#
# What differs from a cluster: every NodeName shares this host's NodeHostname, each slurmd has
# its own port (`slurmd -N name`), and the daemons bind loopback only.
set -euo pipefail

need() {
    command -v "$1" > /dev/null || {
        echo "one_host_slurm: \`$1\` is missing: install Debian's slurmctld slurmd slurm-client munge (apt-get install -y slurmctld slurmd slurm-client munge)" >&2
        exit 2
    }
}

start() {
    local dir=$1 nodes=$2 base=$3
    for c in munged slurmctld slurmd sbatch scontrol scancel squeue; do need "$c"; done
    mkdir -p "$dir/spool" "$dir/state" "$dir/log"
    if ! munge -n > /dev/null 2>&1; then
        [[ -f /etc/munge/munge.key ]] || {
            mungekey --create --keyfile=/etc/munge/munge.key
            chown munge:munge /etc/munge/munge.key
            chmod 0400 /etc/munge/munge.key
        }
        mkdir -p /run/munge /var/log/munge /var/lib/munge
        chown munge:munge /run/munge /var/log/munge /var/lib/munge
        runuser -u munge -- /usr/sbin/munged
        for _ in $(seq 50); do munge -n > /dev/null 2>&1 && break; sleep 0.1; done
        munge -n > /dev/null || { echo "one_host_slurm: munged did not start" >&2; exit 1; }
    fi
    local host
    host=$(command hostname)
    {
        echo "ClusterName=sluice-test"
        echo "SlurmctldHost=$host(127.0.0.1)"
        echo "SlurmctldPort=$base"
        echo "SlurmdPort=$((base + 1))"
        echo "SlurmUser=root"
        echo "AuthType=auth/munge"
        echo "CredType=cred/munge"
        echo "CommunicationParameters=NoInAddrAny,NoCtldInAddrAny"
        echo "ProctrackType=proctrack/linuxproc"
        echo "TaskPlugin=task/none"
        echo "SelectType=select/cons_tres"
        echo "SelectTypeParameters=CR_Core"
        echo "AccountingStorageType=accounting_storage/none"
        echo "JobAcctGatherType=jobacct_gather/none"
        echo "JobCompType=jobcomp/none"
        echo "ReturnToService=2"
        echo "MpiDefault=none"
        echo "SlurmdParameters=config_overrides"
        echo "StateSaveLocation=$dir/state"
        echo "SlurmdSpoolDir=$dir/spool/%n"
        echo "SlurmctldPidFile=$dir/slurmctld.pid"
        echo "SlurmdPidFile=$dir/slurmd-%n.pid"
        echo "SlurmctldLogFile=$dir/log/slurmctld.log"
        echo "SlurmdLogFile=$dir/log/slurmd-%n.log"
        echo "SchedulerParameters=sched_interval=1"
        echo "MessageTimeout=10"
        echo "KillWait=30"
        echo "InactiveLimit=0"
        echo "MinJobAge=300"
        for i in $(seq 1 "$nodes"); do
            echo "NodeName=n$i NodeHostname=$host NodeAddr=127.0.0.1 Port=$((base + 1 + i)) CPUs=2 State=UNKNOWN"
        done
        echo "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO"
    } > "$dir/slurm.conf"
    export SLURM_CONF=$dir/slurm.conf
    slurmctld -f "$dir/slurm.conf" -i
    for i in $(seq 1 "$nodes"); do
        mkdir -p "$dir/spool/n$i"
        slurmd -f "$dir/slurm.conf" -N "n$i"
    done
    for _ in $(seq 300); do
        if [[ $(sinfo -h -o '%t' -p test 2>/dev/null | tr -d '\n') == idle ]] && \
           [[ $(sinfo -h -N -o '%N %t' 2>/dev/null | grep -c ' idle') == "$nodes" ]]; then
            return 0
        fi
        sleep 0.2
    done
    echo "one_host_slurm: the nodes did not come up idle:" >&2
    sinfo -N >&2 || true
    tail -20 "$dir/log/"*.log >&2 || true
    exit 1
}

stop() {
    local dir=$1
    for pidfile in "$dir"/slurmd-*.pid "$dir/slurmctld.pid"; do
        [[ -f $pidfile ]] || continue
        pid=$(cat "$pidfile")
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    done
}

case ${1:-} in
    start) start "$2" "$3" "$4" ;;
    stop) stop "$2" ;;
    *) echo "usage: $0 start DIR NODES PORT_BASE | stop DIR" >&2; exit 2 ;;
esac
