#!/usr/bin/env python3
"""Turn bindgen's raw output into gscomm's checked-in bindings (scripts/gen-*-bindings.sh).

    bindgen_fnptr.py RAW OUT HEADER

Functions are not kept as `extern` declarations (those would make the linker look for the
library): each `pub fn NAME(...)` is rewritten into a function-pointer type `NAME_fn`, which the
run-time loader fills with dlsym, so the signatures still come from the C headers. Layout checks
are kept for x86_64 only (the target bindgen ran for). HEADER is a file with the module comment
and attributes that go first.
"""
import re
import sys

raw, out, header = sys.argv[1:4]
src = open(raw).read()


# `unsafe extern "C" { pub fn NAME(ARGS) -> RET; ... }` -> `pub type NAME_fn = unsafe extern "C" fn(ARGS) -> RET;`
def block(m):
    body = m.group(1)
    fns = re.findall(r'pub fn (\w+)\((.*?)\)(\s*->\s*[^;]+)?;', body, re.S)
    out = []
    for name, args, ret in fns:
        args = ' '.join(args.split())
        ret = ' '.join((ret or '').split())
        out.append(f'pub type {name}_fn = unsafe extern "C" fn({args}){(" " + ret) if ret else ""};')
    return '\n'.join(out)


src, n = re.subn(r'unsafe extern "C" \{(.*?)\n\}', block, src, flags=re.S)
assert n > 0, "no extern blocks found: bindgen output changed shape"
assert 'extern "C" {' not in src
src = src.replace('const _: () = {', '#[cfg(target_arch = "x86_64")]\nconst _: () = {')
open(out, 'w').write(open(header).read() + src)
