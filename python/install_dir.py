"""Where `cmake --install` puts the distopt package (python/CMakeLists.txt).

  install_dir.py PREFIX        the directory, relative to PREFIX, that this
                               interpreter searches under PREFIX (Debian's
                               lib/python3/dist-packages under /usr,
                               lib/python3.X/dist-packages under /usr/local,
                               lib/python3.X/site-packages for the user site);
                               else the interpreter's own scheme for PREFIX
  install_dir.py --check DIR   one line when this interpreter does not search
                               DIR: the PYTHONPATH to set
"""

import os
import site
import sys
import sysconfig


def searched():
    paths = [os.path.realpath(p) for p in sys.path if p]
    user = site.getusersitepackages() if site.ENABLE_USER_SITE is not False else None
    return set(paths + ([os.path.realpath(user)] if user else []))


def main(argv):
    if len(argv) == 3 and argv[1] == "--check":
        target = os.path.realpath(argv[2])
        if target not in searched():
            print(f"-- distopt: {sys.executable} does not search {argv[2]}: "
                  f"export PYTHONPATH={argv[2]}${{PYTHONPATH:+:$PYTHONPATH}}")
        return 0
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    prefix = os.path.realpath(os.path.expanduser(argv[1]))
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    candidates = ["lib/python3/dist-packages", f"lib/{version}/dist-packages", f"lib/{version}/site-packages"]
    where = searched()
    for c in candidates:
        if os.path.join(prefix, c) in where:
            print(c)
            return 0
    scheme = sysconfig.get_path("platlib", "posix_prefix", vars={"base": "", "platbase": ""})
    print(scheme.lstrip("/"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
