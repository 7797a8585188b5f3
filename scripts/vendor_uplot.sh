#!/usr/bin/env bash
# Fetch uPlot from npm and copy its minified build into miles_host/dashboard/static/.
# The copied files are committed, so the dashboard fetches nothing at run time; run this
# again only to move to another uPlot version (UPLOT_VERSION, default below).
set -euo pipefail
cd "$(dirname "$0")/.."
version=${UPLOT_VERSION:-1.6.32}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "uplot@$version" >/dev/null && tar -xzf "uplot-$version.tgz")
dest=miles_host/dashboard/static/vendor
mkdir -p "$dest"
cp "$work/package/dist/uPlot.iife.min.js" "$dest/uPlot.iife.min.js"
cp "$work/package/dist/uPlot.min.css" "$dest/uPlot.min.css"
cp "$work/package/LICENSE" "$dest/uPlot.LICENSE"
printf 'uPlot %s (npm package "uplot", MIT license: uPlot.LICENSE), fetched by scripts/vendor_uplot.sh\n' \
  "$version" > "$dest/VERSION"
echo "uPlot $version copied to $dest"
