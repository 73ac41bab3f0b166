#!/usr/bin/env bash
# cg.sh NAME LIMIT CMD...: run CMD in a fresh cgroup v1 memory cgroup of LIMIT bytes (process + page cache),
# page cache dropped first; prints the cgroup's peak and the OOM-kill count after.
set -u
name=$1; limit=$2; shift 2
cg=/sys/fs/cgroup/memory/$name
rmdir $cg 2>/dev/null; mkdir -p $cg
echo $limit > $cg/memory.limit_in_bytes
sync; echo 3 > /proc/sys/vm/drop_caches
bash -c "echo \$\$ > $cg/cgroup.procs; exec \"\$@\"" _ "$@"
rc=$?
echo "cgroup $name: rc $rc, peak $(cat $cg/memory.max_usage_in_bytes) bytes, oom_kill $(grep oom_kill $cg/memory.oom_control | awk '{print $2}')" >&2
rmdir $cg 2>/dev/null
exit $rc
