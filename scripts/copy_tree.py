#!/usr/bin/env python3
"""Copy the project's source tree (what git tracks, plus untracked files git does
not ignore) to DEST: no virtual environments, builds or built extensions.

    python scripts/copy_tree.py DEST [--root ROOT]

Used where a build or test must not disturb the checkout (scripts/cuda_build_check.sh,
tests/test_build.py). Without git (a source archive), everything under ROOT is
copied except what .gitignore lists at the top (.venv*, build/, *.so, ...).
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import shutil
import subprocess
import sys

# Without git: never copied (the .gitignore's patterns that matter for a build).
_IGNORED = (".git", ".venv*", "build", "*.egg-info", "__pycache__", "*.so", "*.o", ".pytest_cache", "runs",
            "_C*.json")


def source_files(root: str) -> list:
    try:
        out = subprocess.run(["git", "-C", root, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, check=True).stdout
        files = [f for f in out.decode().split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        files = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if not any(fnmatch.fnmatch(d, p) for p in _IGNORED)]
            for name in filenames:
                if not any(fnmatch.fnmatch(name, p) for p in _IGNORED):
                    files.append(os.path.relpath(os.path.join(dirpath, name), root))
    # A tracked file deleted in the working tree is not copied.
    return sorted(f for f in files if os.path.isfile(os.path.join(root, f)))


def copy_tree(root: str, dest: str) -> int:
    files = source_files(root)
    for rel in files:
        target = os.path.join(dest, rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(os.path.join(root, rel), target)
    return len(files)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest")
    parser.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    args = parser.parse_args(argv)
    n = copy_tree(os.path.abspath(args.root), os.path.abspath(args.dest))
    print(f"copied {n} files from {args.root} to {args.dest}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
