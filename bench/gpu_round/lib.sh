# Sourced by run.sh. `stage NAME SECONDS CMD...` runs CMD with a timeout of min(SECONDS, what is left of the area's
# limit), output to $OUT/$AREA/NAME.log (tail printed); in DRY mode it checks CMD instead (check_cmd.py).
DRY_FAILS=0
stage() {
  local name=$1 secs=$2; shift 2
  if [ "$DRY" = 1 ]; then
    python3 bench/gpu_round/check_cmd.py "$@" || DRY_FAILS=$(( DRY_FAILS + 1 ))
    return 0
  fi
  local left=$(( AREA_END - $(date +%s) ))
  [ "$left" -lt "$secs" ] && secs=$left
  if [ "$secs" -lt 10 ]; then echo "--- $AREA/$name skipped: area time used up"; return 0; fi
  local t0=$(date +%s)
  timeout -k 5 "$secs" "$@" > "$OUT/$AREA/$name.log" 2>&1
  local rc=$?
  echo "--- $AREA/$name rc=$rc $(( $(date +%s) - t0 ))s/$secs"
  tail -n "${TAIL:-15}" "$OUT/$AREA/$name.log"
}
