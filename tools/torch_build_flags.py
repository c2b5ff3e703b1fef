"""Where the PyTorch that fusedce.torch will run with keeps its C++ headers and libraries, for Meson
(bindings/python/src/meson.build), one item per line:
    version, cxx11 ABI (0/1), CUDA version ('' without CUDA), library folder, include folders...
Exits 1, saying why on stderr, when no torch is found. torch is looked for on sys.path, then in this
interpreter's own site-packages (sysconfig's purelib and platlib; with a venv's system site-packages, the
base interpreter's too), which pip's build isolation takes off sys.path: the package is built against the
torch of the environment it is installed into."""
import os
import sys
import sysconfig


def _site_dirs():
    """This interpreter's site-packages, and the base interpreter's for a venv made with
    --system-site-packages (pyvenv.cfg): where the installed package will find its torch."""
    dirs = [sysconfig.get_paths()[k] for k in ("purelib", "platlib")]
    cfg = os.path.join(sys.prefix, "pyvenv.cfg")
    if sys.prefix != sys.base_prefix and os.path.exists(cfg):
        with open(cfg) as fh:
            system = any(line.split("=")[0].strip() == "include-system-site-packages"
                         and line.split("=", 1)[1].strip().lower() == "true" for line in fh if "=" in line)
        if system:
            base = {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}
            dirs += [sysconfig.get_paths(vars=base)[k] for k in ("purelib", "platlib")]
    return dirs


def main():
    try:
        import torch  # noqa: F401
    except ImportError:
        for d in _site_dirs():
            if d not in sys.path and os.path.isdir(os.path.join(d, "torch")):
                sys.path.append(d)
        try:
            import torch  # noqa: F401
        except ImportError as e:
            print("no torch: %s" % e, file=sys.stderr)
            return 1
    import torch
    from torch.utils import cpp_extension

    root = os.path.dirname(torch.__file__)
    print(torch.__version__)
    print(int(torch._C._GLIBCXX_USE_CXX11_ABI))
    print(torch.version.cuda or "")
    print(os.path.join(root, "lib"))
    for d in cpp_extension.include_paths():
        print(d)
    return 0


if __name__ == "__main__":
    sys.exit(main())
