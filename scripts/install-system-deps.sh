#!/usr/bin/env bash
# Install the Debian packages dslurm needs: the local real Slurm (slurmctld, slurmd, client),
# munge, tini, accounting (slurmdbd + MariaDB, for sacct/submitit), shellcheck, and ssh + sshd
# (the remote tests put a real sshd on loopback in front of the local cluster: docs/remote.md).
# Idempotent: a quick no-op when everything is installed. Needs root (or sudo).
set -euo pipefail

packages=(slurmctld slurmd slurm-client munge tini slurmdbd mariadb-server shellcheck openssh-server openssh-client)

missing=()
for pkg in "${packages[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$pkg")
    fi
done
if [ "${#missing[@]}" -eq 0 ]; then
    echo "install-system-deps: all installed (${packages[*]})"
    exit 0
fi

sudo=()
if [ "$(id -u)" -ne 0 ]; then
    if ! command -v sudo >/dev/null; then
        echo "install-system-deps: missing ${missing[*]}; run as root:" >&2
        echo "  apt-get install --no-install-recommends ${missing[*]}" >&2
        exit 1
    fi
    sudo=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive
echo "install-system-deps: installing ${missing[*]}"
if ! "${sudo[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"; then
    # Stale package lists are the usual cause on a fresh machine.
    "${sudo[@]}" apt-get update -q
    "${sudo[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
