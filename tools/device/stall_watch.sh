#!/usr/bin/env bash
# What the processes of a stalled run are doing (issue #7's intermittent stalls).
#   bash tools/device/stall_watch.sh AFTER_S PATTERN OUTFILE
# After AFTER_S seconds, for every process whose command line matches PATTERN: each thread's
# name, state, kernel wait channel and current system call (x86-64 numbers: 202 futex, 16
# ioctl — inside the GPU driver —, 7 poll, 232 epoll_wait, 35 nanosleep, 0 read), and, where
# gdb or eu-stack exists, each thread's user-space stack (the device machines have neither:
# after gpu-bundle, `cp /usr/bin/eu-stack /lib/x86_64-linux-gnu/lib{dw,elf}.so.1 .gpu/dbg/` here, from Debian's
# elfutils, and the script finds them there). Start it in the background beside the run and kill
# it when the run ends in time.
after=$1 pat=$2 out=$3
sleep "$after"
for pid in $(pgrep -f "$pat"); do
    echo "== pid $pid: $(tr '\0' ' ' < "/proc/$pid/cmdline" | cut -c1-200)"
    for t in /proc/"$pid"/task/*; do
        echo "  tid ${t##*/} $(cat "$t/comm") state=$(awk '/^State/{print $2}' "$t/status") wchan=$(cat "$t/wchan") syscall=$(cut -d' ' -f1 "$t/syscall")"
    done
    if command -v gdb > /dev/null; then
        timeout 30 gdb -p "$pid" -batch -ex 'thread apply all bt 14' 2> /dev/null | grep -E '^Thread|^#'
    elif [ -x .gpu/dbg/eu-stack ]; then
        LD_LIBRARY_PATH=.gpu/dbg timeout 30 .gpu/dbg/eu-stack -p "$pid" -n 24 2>&1 | grep -v '^$'
    fi
done > "$out" 2>&1
