#!/bin/sh
# Install the Debian packages behind the commands a make target needs, when a command is missing.
#
#   sh tests/debian-tools.sh TARGET COMMAND:PACKAGE...
#
# As root with apt-get: installs the missing ones, starting nothing as a system service (a
# policy-rc.d that refuses every start is in place during the install, where none exists).
# Otherwise: one line naming what to install, and exit 1.
set -eu
target=$1
shift
missing="" packages=""
for pair in "$@"; do
  command=${pair%%:*} package=${pair#*:}
  if ! command -v "$command" >/dev/null 2>&1; then
    missing="$missing $command"
    case " $packages " in *" $package "*) ;; *) packages="$packages $package" ;; esac
  fi
done
[ -z "$packages" ] && exit 0
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "$target needs$missing: run as root (it installs them) or: sudo apt-get install$packages" >&2
  exit 1
fi
echo "$target: installing$packages (Debian) for$missing" >&2
added_policy=""
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && added_policy=1
fi
status=0
{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $packages >/dev/null; } || status=$?
[ -n "$added_policy" ] && rm -f /usr/sbin/policy-rc.d
if [ "$status" -ne 0 ]; then
  echo "$target: apt-get install$packages failed (exit $status); install them by hand" >&2
  exit 1
fi
