#!/usr/bin/env python3
"""Generate docs/C_API.md, the C API reference, from the comments of include/gsc.h.

    python3 scripts/gen-capi-doc.py            # rewrite docs/C_API.md
    python3 scripts/gen-capi-doc.py --check    # exit 1 if docs/C_API.md is out of date
    python3 scripts/gen-capi-doc.py --header H --output F

The header is the source: its leading file comment becomes the introduction, each section
banner a section (in header order), and each declaration an entry with its doc comment:
functions with their prototype, types with their fields or values, macros with their value.
A `/** ... */` comment documents the declaration after it, a `/**< ... */` comment the member
before it. Standard library only; the output depends on the header alone (tests/capi_doc.rs
checks that the committed file is what this script writes).

Anything the script cannot classify is an error (exit 2), so a header change that the reference
would silently drop fails the test instead.
"""

import argparse
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_HEADER = os.path.join(ROOT, "include", "gsc.h")
DEFAULT_OUTPUT = os.path.join(ROOT, "docs", "C_API.md")

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


class HeaderError(Exception):
    pass


# ----------------------------------------------------------------------------------------------
# Scanning: the header as a list of comments, preprocessor directives and C declarations
# ----------------------------------------------------------------------------------------------


class Item:
    """One piece of the header: kind is 'comment', 'directive' or 'code'."""

    def __init__(self, kind, text, line):
        self.kind = kind
        self.text = text
        self.line = line


def skip_comment(text, i):
    """Index just past the comment that starts at text[i] ('/*')."""
    end = text.find("*/", i + 2)
    if end < 0:
        raise HeaderError("unterminated comment at line %d" % line_of(text, i))
    return end + 2


def line_of(text, i):
    return text.count("\n", 0, i) + 1


def scan(text):
    items = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c.isspace():
            i += 1
        elif text.startswith("/*", i):
            j = skip_comment(text, i)
            items.append(Item("comment", text[i:j], line_of(text, i)))
            i = j
        elif text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            items.append(Item("comment", "/*" + text[i + 2 : j] + " */", line_of(text, i)))
            i = j
        elif c == "#":
            # A directive runs to the end of the line, continued by backslashes; a comment at its
            # end stays part of it (it is stripped where the directive is read).
            j = i
            while True:
                k = text.find("\n", j)
                k = n if k < 0 else k
                if text[j:k].rstrip().endswith("\\"):
                    j = k + 1
                    continue
                break
            directive = text[i:k]
            if re.match(r"#\s*ifdef\s+__cplusplus\b", directive):
                # extern "C" guards: not part of the API; skip to the matching #endif.
                k = skip_conditional(text, k)
            else:
                items.append(Item("directive", directive, line_of(text, i)))
            i = k
        else:
            # A declaration: up to the ';' outside braces; comments inside are kept.
            j, depth = i, 0
            while True:
                if j >= n:
                    raise HeaderError("declaration without ';' at line %d" % line_of(text, i))
                if text.startswith("/*", j):
                    j = skip_comment(text, j)
                    continue
                ch = text[j]
                if ch == "{":
                    depth += 1
                elif ch == "}":
                    depth -= 1
                elif ch == ";" and depth == 0:
                    j += 1
                    break
                elif ch == "#" and text[j - 1] == "\n":
                    raise HeaderError("directive inside the declaration that starts at line %d" % line_of(text, i))
                j += 1
            items.append(Item("code", text[i:j], line_of(text, i)))
            i = j
    return items


def skip_conditional(text, i):
    """Index just past the #endif that closes the conditional whose first line ends at i."""
    depth = 1
    for m in re.finditer(r"^[ \t]*#[ \t]*(if|ifdef|ifndef|endif)\b.*$", text[i:], flags=re.M):
        depth += -1 if m.group(1) == "endif" else 1
        if depth == 0:
            return i + m.end()
    raise HeaderError("#ifdef __cplusplus without #endif at line %d" % line_of(text, i))


def strip_comments(code):
    return re.sub(r"/\*.*?\*/", " ", code, flags=re.S)


# ----------------------------------------------------------------------------------------------
# Comments
# ----------------------------------------------------------------------------------------------


def comment_kind(text):
    if text.startswith("/**<"):
        return "member"
    if text.startswith("/**") and not text.startswith("/**/"):
        return "doc"
    return "plain"


def comment_lines(text):
    """The lines of a comment's body, without the delimiters and the leading ' * '."""
    body = text[2:-2]
    if body.startswith("*<"):
        body = body[2:]
    elif body.startswith("*"):
        body = body[1:]
    lines = body.split("\n")
    out = []
    for k, line in enumerate(lines):
        s = line.strip()
        if k > 0 and s.startswith("*"):
            s = s[1:]
        out.append(s.rstrip())
    # Drop blank lines at both ends.
    while out and not out[0].strip():
        out.pop(0)
    while out and not out[-1].strip():
        out.pop()
    return out


def is_rule(line):
    s = line.strip()
    return len(s) >= 3 and set(s) == {"-"}


def banner_text(item):
    """The text of a section banner comment, or None when the comment is not one.

    Two shapes: a comment that is only a rule (`/* ---- */`, then `/* Title */` lines, then
    another rule), handled by the caller; and a comment whose first line is a rule followed by
    the text (`/* ----\n * Title: text */`), returned here."""
    if comment_kind(item.text) != "plain":
        return None
    lines = item.text[2:-2].split("\n")
    if len(lines) > 1 and is_rule(lines[0]):
        rest = [l.strip() for l in lines[1:]]
        rest = [l[1:].strip() if l.startswith("*") else l for l in rest]
        return " ".join(l for l in rest if l)
    return None


def is_rule_comment(item):
    return item.kind == "comment" and comment_kind(item.text) == "plain" and is_rule(item.text[2:-2])


def doc_to_markdown(lines):
    """A doc comment's lines as Markdown: paragraphs kept, `@param`/`@return` as a list,
    underlined titles as bold lines."""
    out = []
    k = 0
    in_tags = False
    while k < len(lines):
        line = lines[k]
        s = line.strip()
        if k + 1 < len(lines) and s and is_rule(lines[k + 1]) and not is_rule(s):
            out.append("**%s**" % s)
            out.append("")
            k += 2
            continue
        m = re.match(r"@param\s+(%s)\s*(.*)" % IDENT, s)
        if m or s.startswith("@return"):
            if not in_tags and out and out[-1]:
                out.append("")  # the tags' list starts a block of its own
            in_tags = True
            if m:
                out.append("- `%s`: %s" % (m.group(1), m.group(2)))
            else:
                out.append("- returns: %s" % s[len("@return") :].strip())
        else:
            in_tags = in_tags and bool(s)
            out.append(s)
        k += 1
    return "\n".join(out).strip()


# ----------------------------------------------------------------------------------------------
# Declarations
# ----------------------------------------------------------------------------------------------


class Entry:
    """One documented thing: kind is 'function', 'macro', 'type', 'enum' or 'struct'."""

    def __init__(self, kind, name, code, doc, line):
        self.kind = kind
        self.name = name
        self.code = code  # the declaration, as C, without comments
        self.doc = doc  # Markdown
        self.line = line
        self.members = []  # (name, value or None, Markdown doc)
        self.value = None  # object-like macros


def normalize_code(code):
    """A declaration without its comments and trailing spaces. Lines that held only a comment
    go; blank lines of the header stay (one at most), as does the indentation."""
    marked = re.sub(r"/\*.*?\*/", "\0", code, flags=re.S)
    lines = []
    for line in marked.split("\n"):
        if line.strip() and not line.replace("\0", "").strip():
            continue  # a comment alone on its line
        line = line.replace("\0", "").rstrip()
        if not line and (not lines or not lines[-1]):
            continue
        lines.append(line)
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


def declarator_name(decl):
    """The declared identifier of one member or parameter-free declarator."""
    decl = decl.strip()
    m = re.search(r"\(\s*\*\s*(%s)\s*\)\s*\(" % IDENT, decl)  # function pointer
    if m:
        return m.group(1)
    decl = re.sub(r"\[[^\]]*\]\s*$", "", decl).strip()
    m = re.search(r"(%s)\s*$" % IDENT, decl)
    if not m:
        raise HeaderError("cannot find the name in %r" % decl)
    return m.group(1)


def split_body(body):
    """The inside of braces as a list of ('comment', text) and ('code', text) pieces."""
    pieces = []
    i, n, start = 0, len(body), 0
    while i < n:
        if body.startswith("/*", i):
            if body[start:i].strip():
                pieces.append(("code", body[start:i]))
            j = skip_comment(body, i)
            pieces.append(("comment", body[i:j]))
            i = start = j
        else:
            i += 1
    if body[start:].strip():
        pieces.append(("code", body[start:]))
    return pieces


def outer_braces(code):
    """(start, end) of the first '{' and its matching '}' in code (comments skipped)."""
    i, depth, start = 0, 0, None
    while i < len(code):
        if code.startswith("/*", i):
            i = skip_comment(code, i)
            continue
        if code[i] == "{":
            if depth == 0:
                start = i
            depth += 1
        elif code[i] == "}":
            depth -= 1
            if depth == 0:
                return start, i
        i += 1
    raise HeaderError("unbalanced braces in %r" % code[:60])


def enum_members(body, line):
    """[(name, value, doc)] of an enum body: `/**<` documents the enumerator before it, `/**`
    the one after it."""
    members, pending = [], None
    for kind, text in split_body(body):
        if kind == "comment":
            ck = comment_kind(text)
            if ck == "member":
                if not members:
                    raise HeaderError("member comment before any enumerator near line %d" % line)
                name, value, doc = members[-1]
                members[-1] = (name, value, join_doc(doc, doc_to_markdown(comment_lines(text))))
            elif ck == "doc":
                pending = doc_to_markdown(comment_lines(text))
            continue
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            m = re.match(r"(%s)\s*(?:=\s*(.+))?$" % IDENT, part, flags=re.S)
            if not m:
                raise HeaderError("cannot read enumerator %r near line %d" % (part, line))
            value = " ".join(m.group(2).split()) if m.group(2) else None
            members.append((m.group(1), value, pending or ""))
            pending = None
    return members


def join_doc(a, b):
    return (a + "\n\n" + b).strip() if a else b


def struct_members(body, line, prefix=""):
    """[(name, None, doc)] of a struct or union body; the members of a nested union or struct
    follow its own row, named `outer.inner`."""
    members, pending, last = [], None, None
    i, n, start, depth = 0, len(body), 0, 0
    while i < n:
        if body.startswith("/*", i):
            j = skip_comment(body, i)
            if depth == 0:
                text = body[i:j]
                kind = comment_kind(text)
                before = strip_comments(body[start:i]).strip()
                if kind == "member":
                    if before or last is None:
                        raise HeaderError("member comment that follows no member near line %d" % line)
                    name, value, doc = members[last]
                    members[last] = (name, value, join_doc(doc, doc_to_markdown(comment_lines(text))))
                    start = j
                elif kind == "doc":
                    if before:
                        raise HeaderError("doc comment inside a member near line %d" % line)
                    pending = doc_to_markdown(comment_lines(text))
                    start = j
            i = j
            continue
        ch = body[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif ch == ";" and depth == 0:
            decl = body[start:i]
            if "{" in strip_comments(decl):
                s, e = outer_braces(decl)
                full = prefix + declarator_name(strip_comments(decl[e + 1 :]))
                members.append((full, None, pending or ""))
                last = len(members) - 1
                members.extend(struct_members(decl[s + 1 : e], line, full + "."))
            else:
                members.append((prefix + declarator_name(strip_comments(decl)), None, pending or ""))
                last = len(members) - 1
            pending = None
            start = i + 1
        i += 1
    if strip_comments(body[start:]).strip():
        raise HeaderError("member without ';' near line %d" % line)
    return members


def classify(code, doc, line):
    """The Entry for one declaration (code with its inner comments), or None to skip it."""
    flat = " ".join(strip_comments(code).split())
    if flat.startswith("typedef enum"):
        m = re.search(r"\}\s*(%s)\s*;$" % IDENT, flat)
        if not m:
            raise HeaderError("cannot read the enum typedef at line %d" % line)
        e = Entry("enum", m.group(1), normalize_code(code), doc, line)
        s, t = outer_braces(code)
        e.members = enum_members(code[s + 1 : t], line)
        return e
    if re.match(r"typedef (struct|union) (%s )?\{" % IDENT, flat):
        m = re.search(r"\}\s*(%s)\s*;$" % IDENT, flat)
        if not m:
            raise HeaderError("cannot read the struct typedef at line %d" % line)
        e = Entry("struct", m.group(1), normalize_code(code), doc, line)
        s, t = outer_braces(code)
        e.members = struct_members(code[s + 1 : t], line)
        return e
    if flat.startswith("typedef "):
        return Entry("type", declarator_name(flat.rstrip(";")), normalize_code(code), doc, line)
    m = re.match(r"(.*?)\b(%s)\s*\((.*)\)\s*;$" % IDENT, flat, flags=re.S)
    if m and "{" not in flat:
        return Entry("function", m.group(2), normalize_code(code), doc, line)
    raise HeaderError("cannot classify the declaration at line %d: %r" % (line, flat[:80]))


def classify_directive(text, doc, line):
    """An Entry for a #define, or None for other directives."""
    flat = strip_comments(text).replace("\\\n", "\n")
    m = re.match(r"#\s*define\s+(%s)(\([^)]*\))?(.*)$" % IDENT, flat, flags=re.S)
    if not m:
        return None
    name, params, value = m.group(1), m.group(2), m.group(3)
    if params:
        e = Entry("macro", name + params, normalize_code(text), doc, line)
        e.name = name
        e.signature = name + params
        e.function_like = True
        return e
    e = Entry("macro", name, normalize_code(text), doc, line)
    e.value = " ".join(value.split())
    e.function_like = False
    return e


# ----------------------------------------------------------------------------------------------
# The header as sections of entries
# ----------------------------------------------------------------------------------------------


class Section:
    def __init__(self, title, text, line):
        self.title = title
        self.text = text  # Markdown under the title
        self.line = line
        self.entries = []


def split_title(text):
    """'Title: more text' -> ('Title', 'More text.'); a short banner is all title."""
    m = re.match(r"([^:]{1,60}):\s+(.*)$", text, flags=re.S)
    if m:
        rest = m.group(2).strip()
        rest = rest[0].upper() + rest[1:]
        if not rest.endswith((".", ")")):
            rest += "."
        elif rest.endswith(")") and not rest.endswith(".)"):
            rest += "."
        return m.group(1).strip(), rest
    return text.strip(), ""


def parse(text):
    items = scan(text)
    intro = None
    sections = []
    pending = None  # (Markdown, line) of the last doc comment
    guard = None
    k = 0
    while k < len(items):
        it = items[k]
        if it.kind == "comment":
            if intro is None and not sections and k == 0 and comment_kind(it.text) == "plain":
                intro = doc_to_markdown(comment_lines(it.text))
                k += 1
                continue
            if is_rule_comment(it):
                # /* ---- */ /* Title */ ... /* ---- */
                titles = []
                k += 1
                while k < len(items) and items[k].kind == "comment" and not is_rule_comment(items[k]):
                    titles.append(" ".join(comment_lines(items[k].text)))
                    k += 1
                if k >= len(items) or not is_rule_comment(items[k]):
                    raise HeaderError("section banner at line %d is not closed by a rule" % it.line)
                title, rest = split_title(" ".join(titles))
                sections.append(Section(title, rest, it.line))
                pending = None
                k += 1
                continue
            b = banner_text(it)
            if b is not None:
                title, rest = split_title(b)
                sections.append(Section(title, rest, it.line))
                pending = None
                k += 1
                continue
            kind = comment_kind(it.text)
            if kind == "doc":
                if pending is not None:
                    raise HeaderError("doc comment at line %d documents nothing" % pending[1])
                pending = (doc_to_markdown(comment_lines(it.text)), it.line)
            elif kind == "member":
                raise HeaderError("member comment outside a type at line %d" % it.line)
            k += 1
            continue
        if it.kind == "directive":
            flat = " ".join(strip_comments(it.text).split())
            if flat.startswith("#ifndef ") and guard is None and not sections:
                guard = flat.split()[1]
            elif flat.startswith("#define ") and flat.split()[1] == guard:
                pass
            elif flat.startswith("#define"):
                e = classify_directive(it.text, pending[0] if pending else "", it.line)
                if not sections:
                    raise HeaderError("declaration before the first section at line %d" % it.line)
                sections[-1].entries.append(e)
                pending = None
            k += 1
            continue
        if not sections:
            raise HeaderError("declaration before the first section at line %d" % it.line)
        e = classify(it.text, pending[0] if pending else "", it.line)
        sections[-1].entries.append(e)
        pending = None
        k += 1
    if pending is not None:
        raise HeaderError("doc comment at line %d documents nothing" % pending[1])
    return intro or "", sections


# ----------------------------------------------------------------------------------------------
# Markdown
# ----------------------------------------------------------------------------------------------


def anchor(title):
    """The anchor GitHub (and most renderers) give a heading."""
    a = title.strip().lower()
    a = re.sub(r"[^\w\- ]", "", a)
    return a.replace(" ", "-")


def cell(text):
    """Markdown for a table cell: one line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


class Linker:
    """Turns `gsc_x()` and type names in doc text into links to their entries."""

    def __init__(self, targets):
        self.targets = targets  # name -> anchor
        names = sorted(targets, key=len, reverse=True)
        self.pattern = re.compile(r"\b(%s)\b(\(\))?" % "|".join(re.escape(n) for n in names)) if names else None

    def __call__(self, text):
        if not self.pattern:
            return text
        parts = re.split(r"(`[^`]*`|\[[^\]]*\]\([^)]*\))", text)
        for k in range(0, len(parts), 2):
            parts[k] = self.pattern.sub(lambda m: "[`%s%s`](#%s)" % (m.group(1), m.group(2) or "", self.targets[m.group(1)]),
                                        parts[k])
        return "".join(parts)


# Object-like macros whose doc is longer than this get an entry of their own, not a table row.
TABLE_DOC_MAX = 320


def in_table(e):
    return e.kind == "macro" and not e.function_like and len(e.doc) <= TABLE_DOC_MAX and "\n\n" not in e.doc


def render(intro, sections, header_rel):
    out = []
    w = out.append
    w("# gscomm C API reference")
    w("")
    w("Generated from [`%s`](../%s) by `scripts/gen-capi-doc.py`; do not edit by hand. After changing "
      "the header, run `python3 scripts/gen-capi-doc.py` (tests/capi_doc.rs fails while this file is "
      "out of date)." % (header_rel, header_rel))
    w("")
    w("The user guide ([USER_GUIDE.md](USER_GUIDE.md)) explains the concepts; this page lists every "
      "declaration of the header in its order.")
    w("")

    targets = {}
    for s in sections:
        for e in s.entries:
            if e.kind != "macro" or not in_table(e):
                targets[e.name] = anchor(e.name)
    link = Linker(targets)

    w("## Contents")
    w("")
    w("- [Overview](#overview)")
    for s in sections:
        w("- [%s](#%s)" % (s.title, anchor(s.title)))
    w("")
    w("## Overview")
    w("")
    w(link(intro))
    w("")

    for s in sections:
        w("## %s" % s.title)
        w("")
        if s.text:
            w(link(s.text))
            w("")
        k = 0
        entries = s.entries
        while k < len(entries):
            e = entries[k]
            if in_table(e):
                # A run of object-like macros with short docs is one table.
                w("| macro | value | meaning |")
                w("| --- | --- | --- |")
                while k < len(entries) and in_table(entries[k]):
                    m = entries[k]
                    w("| `%s` | `%s` | %s |" % (m.name, cell(m.value), cell(link(m.doc))))
                    k += 1
                w("")
                continue
            w("### `%s`" % e.name)
            w("")
            w("```c")
            w(e.code)
            w("```")
            w("")
            if e.doc:
                w(link(e.doc))
                w("")
            if e.kind == "enum" and any(doc for _, _, doc in e.members):
                w("| name | value | meaning |")
                w("| --- | ---: | --- |")
                for name, value, doc in e.members:
                    w("| `%s` | %s | %s |" % (name, "`%s`" % cell(value) if value else "", cell(link(doc))))
                w("")
            elif e.kind == "struct" and e.members:
                w("| field | meaning |")
                w("| --- | --- |")
                for name, _, doc in e.members:
                    w("| `%s` | %s |" % (name, cell(link(doc))))
                w("")
            k += 1
    text = "\n".join(out)
    text = re.sub(r"\n{3,}", "\n\n", text).rstrip("\n") + "\n"
    return text


def check_complete(text, sections):
    """Every function the header declares and every macro it defines has an entry."""
    code = strip_comments(text)
    have = {e.name for s in sections for e in s.entries}
    functions = set(re.findall(r"\b(gsc_[A-Za-z0-9_]*)\s*\(", code))
    macros = set(re.findall(r"^[ \t]*#[ \t]*define[ \t]+(%s)" % IDENT, code, flags=re.M))
    macros.discard(re.search(r"#\s*ifndef\s+(%s)" % IDENT, code).group(1))
    missing = sorted((functions | macros) - have)
    if missing:
        raise HeaderError("left out of the reference: " + ", ".join(missing))


def generate(header_path):
    with open(header_path, encoding="utf-8") as f:
        text = f.read()
    intro, sections = parse(text)
    check_complete(text, sections)
    rel = os.path.relpath(os.path.abspath(header_path), ROOT).replace(os.sep, "/")
    if rel.startswith(".."):
        rel = "include/" + os.path.basename(header_path)
    return render(intro, sections, rel)


def main(argv):
    ap = argparse.ArgumentParser(description="Generate the C API reference (docs/C_API.md) from include/gsc.h.")
    ap.add_argument("--header", default=DEFAULT_HEADER, help="the header (default: include/gsc.h)")
    ap.add_argument("--output", default=DEFAULT_OUTPUT, help="where to write (default: docs/C_API.md; - for stdout)")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if the output file differs")
    args = ap.parse_args(argv)
    try:
        doc = generate(args.header)
    except (HeaderError, OSError) as e:
        sys.stderr.write("gen-capi-doc: %s\n" % e)
        return 2
    if args.check:
        try:
            with open(args.output, encoding="utf-8") as f:
                current = f.read()
        except OSError:
            current = None
        if current != doc:
            sys.stderr.write("gen-capi-doc: %s is out of date; run python3 scripts/gen-capi-doc.py\n" % args.output)
            return 1
        return 0
    if args.output == "-":
        sys.stdout.write(doc)
    else:
        with open(args.output, "w", encoding="utf-8", newline="\n") as f:
            f.write(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
