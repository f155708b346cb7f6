"""``brewnet compat install|uninstall|status [--user] [--force]``: the ``import caffe`` switch for
a whole Python environment (a Jupyter kernel, every script): a ``.pth`` file in site-packages
that installs ``brewnet_alias`` at interpreter start, so ``import caffe`` (and Minerva's
``import owl``) resolve to brewnet. Refuses to shadow a real Caffe unless ``--force``; for one
script, ``brewnet run`` does the same without touching the environment."""
from __future__ import annotations

import os
import site
import sysconfig

COMMAND = "compat"
HELP = "install/uninstall the `import caffe` -> brewnet switch in this Python environment (.pth)"
PTH = "brewnet-caffe-alias.pth"


def pth_line(shadow: bool) -> str:
    """The .pth line: loads brewnet_alias from its file (site-packages are added in an order that
    may put brewnet's own after this file's), only while that file exists."""
    import brewnet_alias

    f = os.path.abspath(brewnet_alias.__file__)
    return ("import os, sys, importlib.util as u; f = %r; s = os.path.isfile(f) and "
            "u.spec_from_file_location('brewnet_alias', f); m = s and u.module_from_spec(s); "
            "s and (sys.modules.setdefault('brewnet_alias', m) is m and s.loader.exec_module(m)); "
            "s and sys.modules['brewnet_alias'].install(shadow=%r)\n" % (f, bool(shadow)))


def add_arguments(p) -> None:
    p.add_argument("action", choices=["install", "uninstall", "status"])
    p.add_argument("--user", action="store_true",
                   help="the user's site-packages instead of this environment's")
    p.add_argument("--force", action="store_true",
                   help="install even where a real Caffe (or owl) is importable, shadowing it")


def pth_path(user: bool) -> str:
    """Where the switch lives: this interpreter's (or the user's) site-packages."""
    return os.path.join(site.getusersitepackages() if user else sysconfig.get_paths()["purelib"], PTH)


def run(args) -> int:
    from .common import CLIError, report
    from .run import real_caffe_refusal

    path = pth_path(args.user)
    on = os.path.isfile(path)
    if args.action == "status":
        real = real_caffe_refusal(False)
        print(f"import caffe -> brewnet: {'on' if on else 'off'} ({path})")
        if real:
            print(f"note: {real.split(';')[0]}: it wins over the switch")
        return 0
    if args.action == "uninstall":
        if on:
            os.remove(path)
            print(f"removed {path}: `import caffe` no longer resolves to brewnet")
        else:
            print(f"nothing to remove: {path} does not exist")
        return 0
    refusal = real_caffe_refusal(args.force)
    if refusal:
        return report(COMMAND, CLIError(refusal.replace("--shadow-caffe", "--force")))
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write(pth_line(args.force))
        os.replace(tmp, path)
    except OSError as e:
        return report(COMMAND, CLIError(f"cannot write {path}: {e.strerror}"
                                        + ("" if args.user else "; try --user")))
    print(f"wrote {path}: `import caffe` now resolves to brewnet in this environment "
          f"(`brewnet compat uninstall{' --user' if args.user else ''}` undoes it)")
    return 0
