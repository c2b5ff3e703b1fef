"""python3 -m fusedce: which libfusedce these bindings load, and what it was built with."""
import fusedce


def main():
    info = fusedce.build_info()
    print(info)
    print("library: %s" % fusedce.library_path)
    print("bindings generated from header %s" % fusedce.HEADER_VERSION)
    for k, v in info.as_dict().items():
        print("  %-21s %r" % (k, v))


if __name__ == "__main__":
    main()
