#!/bin/sh
echo "coverage is not supported with the offline Bazel 4 stand-ins (third_party/bazel4)" >&2
exit 1
