#!/bin/sh
# As the official image: options alone run redis-server, and protected mode is off (the
# official build turns it off at compile time; compose's network is what reaches this port).
set -e
case "$1" in -*) set -- redis-server "$@" ;; esac
if [ "$1" = redis-server ]; then
  shift
  set -- redis-server --protected-mode no "$@"
fi
exec "$@"
