#!/bin/sh
# An actor for `partrain rl serve`, in POSIX shell: curl speaks HTTP, awk steps CartPole and
# writes each segment as a safetensors file. No Python, no partrain, no torch: only the wire
# of docs/rl.md ("Wire contract"). It needs sh, curl, awk and the POSIX utilities (printf,
# sed, mktemp).
#
#   partrain rl serve --env CartPole-v1 --port 8100 &
#   sh examples/rl/actor.sh http://127.0.0.1:8100       # until the learner ends training (410)
#   sh examples/rl/actor.sh http://127.0.0.1:8100 3     # 3 segments, then exit
#
# Settings, from the environment: NUM_ENVS (environments stepped together, default 4),
# ACTOR_NAME (the name the learner counts this actor by, default sh-actor-PID), ACTOR_SEED
# (default 1), PARTRAIN_RL_TOKEN (the learner's bearer token, if it has one), ACTOR_KEEP (a
# directory where every segment sent is kept as seg-N.safetensors).
#
# Each step: the E observations go to the learner's central inference (POST
# /v2/models/policy/infer, Open Inference Protocol, JSON), which answers an action, its
# log-probability and the weights version for each row; awk steps the E CartPoles. Every T
# steps (T: the learner's unroll, from GET /rl/v1/info) the steps become one segment, POST
# /rl/v1/segments. Exit status: 0 when done (the segments sent, or training ended), 1 when the
# learner answers something else (its one-line error is printed), 2 for bad settings.
set -eu
LC_ALL=C  # awk writes 0.5, never 0,5
export LC_ALL

me="actor.sh"
fail() { echo "$me: error: $*" >&2; exit 1; }
usage() { echo "$me: error: $*" >&2; exit 2; }

[ $# -ge 1 ] && [ $# -le 2 ] || { usage "expected: sh actor.sh URL [SEGMENTS]"; }
url=${1%/}
segments=${2:-0}                                  # 0: until the learner answers 410
envs=${NUM_ENVS:-4}
name=${ACTOR_NAME:-sh-actor-$$}
seed=${ACTOR_SEED:-1}
case $segments$envs$seed in *[!0-9]*) usage "expected whole numbers, got SEGMENTS=$segments \
NUM_ENVS=$envs ACTOR_SEED=$seed" ;; esac
[ "$envs" -ge 1 ] || { usage "expected NUM_ENVS >= 1, got $envs"; }
case $name in ''|*[!A-Za-z0-9._-]*) usage "expected ACTOR_NAME of letters, digits, . _ -, got '$name'" ;; esac
command -v curl >/dev/null || { usage "curl is not installed"; }
command -v awk >/dev/null || { usage "awk is not installed"; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
trap 'exit 130' INT TERM

# http METHOD PATH [curl options]: the body goes to $work/body, the headers to $work/headers,
# the status code to stdout. A 503 (a full queue) is tried again after its Retry-After, 30 times.
http() {
    method=$1 path=$2
    shift 2
    if [ -n "${PARTRAIN_RL_TOKEN:-}" ]; then
        set -- -H "Authorization: Bearer $PARTRAIN_RL_TOKEN" "$@"
    fi
    tries=0
    while :; do
        code=$(curl -sS -X "$method" -o "$work/body" -D "$work/headers" -w '%{http_code}' "$@" "$url$path") \
            || fail "no learner answers at $url$path"
        [ "$code" = 503 ] && [ "$tries" -lt 30 ] || break
        tries=$((tries + 1))
        wait=$(sed -n 's/^[Rr]etry-[Aa]fter: *\([0-9][0-9]*\).*/\1/p' "$work/headers")
        sleep "${wait:-1}"
    done
    echo "$code"
}

# the learner's one-line error, {"error": "Expected ... Received: ..."}
said() { sed -n 's/.*"error": *"\(.*\)"}.*/\1/p' "$work/body"; }

# ------------------------------------------------------------------ what the learner wants
code=$(http GET /rl/v1/info)
[ "$code" = 200 ] || fail "GET /rl/v1/info: HTTP $code: $(said)"
field() { sed -n "s/.*\"$1\": *\\([^,}]*\\).*/\\1/p" "$work/body" | tr -d '"'; }
unroll=$(field unroll)
model=$(field policy_model)
obs_shape=$(sed -n 's/.*"obs_shape": *\[\([^]]*\)\].*/\1/p' "$work/body" | tr -d ' ')
num_actions=$(field num_actions)
[ "$obs_shape" = 4 ] && [ "$num_actions" = 2 ] \
    || fail "expected a learner for CartPole (obs_shape [4], 2 actions), got obs_shape [$obs_shape]," \
            "$num_actions actions"

# ------------------------------------------------------------------ CartPole, in awk
# The state: one line per environment, x x_dot theta theta_dot, then the running episode's
# return and steps. The observation is kept as text of 9 significant digits; the request and
# the segment both round that text to float32, so what the policy saw is what the segment holds.
# Whoever writes a state writes the next inference request too: the observations as an OIP
# JSON body, asking for 3 of the 5 outputs.
REQUEST='
function request(obs, envs) {
    gsub(/ /, ",", obs)
    printf "{\"inputs\":[{\"name\":\"obs\",\"shape\":[%d,4],\"datatype\":\"FP32\",\"data\":[%s]}],", envs, obs \
        > (dir "/request")
    printf "\"outputs\":[{\"name\":\"action\"},{\"name\":\"logp\"},{\"name\":\"version\"}]}\n" > (dir "/request")
    close(dir "/request")
}'
awk -v dir="$work" -v envs="$envs" -v seed="$seed" "$REQUEST"'
BEGIN {
    srand(seed)
    for (e = 1; e <= envs; e++) {
        line = sprintf("%.9g %.9g %.9g %.9g", rand() * 0.1 - 0.05, rand() * 0.1 - 0.05,
                       rand() * 0.1 - 0.05, rand() * 0.1 - 0.05)
        print line " 0 0" > (dir "/state")
        obs = obs (e > 1 ? " " : "") line
    }
    request(obs, envs)
}'

# Reads the inference answer, then the state; appends this step to the segment's row files
# (obs, actions, logp, rewards, dones, versions: one line per step), writes the next state and
# request, and appends the returns of the episodes that ended to "returns". The physics is
# gymnasium's CartPole-v1.
STEP="$REQUEST"'
function outputs(s,   n, piece, i, key) {    # the "data" of each output, by its "name"
    gsub(/[ \t\r\n]/, "", s)
    n = split(s, piece, "}")                  # one output object per piece (none nests another)
    for (i = 1; i <= n; i++)
        if (match(piece[i], /"name":"[a-z_]+"/)) {
            key = substr(piece[i], RSTART + 8, RLENGTH - 9)
            if (match(piece[i], /"data":\[[-0-9.eE+,]*\]/))
                out[key] = substr(piece[i], RSTART + 8, RLENGTH - 9)
        }
}
function row(file, text) { print text >> (dir "/" file) }
NR == FNR { answer = answer $0; next }
{ state[FNR] = $0 }
END {
    outputs(answer)
    if (split(out["action"], action, ",") != envs || split(out["logp"], logp, ",") != envs \
        || split(out["version"], version, ",") != envs) {
        print "expected action, logp and version for " envs " rows, got: " answer > "/dev/stderr"
        exit 1
    }
    srand(seed)
    theta_limit = 12 * 2 * 3.141592653589793 / 360
    for (e = 1; e <= envs; e++) {
        split(state[e], s, " ")
        x = s[1]; x_dot = s[2]; theta = s[3]; theta_dot = s[4]
        sep = e > 1 ? " " : ""
        obs = obs sep s[1] " " s[2] " " s[3] " " s[4]
        force = action[e] == 1 ? 10 : -10
        c = cos(theta); sn = sin(theta)
        temp = (force + 0.05 * theta_dot * theta_dot * sn) / 1.1
        theta_acc = (9.8 * sn - c * temp) / (0.5 * (4 / 3 - 0.1 * c * c / 1.1))
        x_acc = temp - 0.05 * theta_acc * c / 1.1
        x += 0.02 * x_dot; x_dot += 0.02 * x_acc; theta += 0.02 * theta_dot; theta_dot += 0.02 * theta_acc
        done = (x < -2.4 || x > 2.4 || theta < -theta_limit || theta > theta_limit) ? 1 : 0
        ret = s[5] + 1; steps = s[6] + 1
        if (done || steps >= 500) {           # terminated, or the time limit (not an end: done 0)
            print ret >> (dir "/returns")
            x = rand() * 0.1 - 0.05; x_dot = rand() * 0.1 - 0.05
            theta = rand() * 0.1 - 0.05; theta_dot = rand() * 0.1 - 0.05
            ret = 0; steps = 0
        }
        line = sprintf("%.9g %.9g %.9g %.9g", x, x_dot, theta, theta_dot)
        next_state = next_state line " " ret " " steps "\n"
        next_obs = next_obs sep line
        actions = actions sep action[e]; logps = logps sep logp[e]; rewards = rewards sep 1
        dones = dones sep done; versions = versions sep version[e]
    }
    row("obs", obs); row("actions", actions); row("logp", logps); row("rewards", rewards)
    row("dones", dones); row("versions", versions)
    printf "%s", next_state > (dir "/state.next")
    request(next_obs, envs)
}'

# ------------------------------------------------------------------ safetensors, in awk
# Prints the segment as printf escapes (\ooo per byte): 8 bytes of little-endian header length,
# the JSON header (tensors' dtype, shape, data_offsets; "__metadata__" of strings), padded with
# spaces to a multiple of 8, then each tensor's little-endian bytes in the order of its offsets.
ENCODE='
function le(n, width,   out, i) {            # n >= 0 as width little-endian bytes
    for (i = 0; i < width; i++) { out = out OCT[n % 256]; n = int(n / 256) }
    return out
}
function f32(x,   sign, e, m) {               # IEEE 754 single precision, nearest
    if (x == 0) return le(0, 4)
    sign = 0
    if (x < 0) { sign = 2147483648; x = -x }
    e = 0
    while (x >= 2) { x /= 2; e++ }
    while (x < 1) { x *= 2; e-- }
    m = int((x - 1) * 8388608 + 0.5)
    if (m == 8388608) { m = 0; e++ }
    if (e < -126) return le(sign, 4)          # too small for a normal float32: signed zero
    if (e > 127) { print "expected a float32, got " x > "/dev/stderr"; exit 1 }
    return le(sign + (e + 127) * 8388608 + m, 4)
}
function text(s,   out, i) {                  # ASCII text as bytes
    for (i = 1; i <= length(s); i++) out = out OCT[ORD[substr(s, i, 1)]]
    return out
}
function add(name, dtype, shape, count,   file, line, v, n, i, got) {
    file = dir "/" name
    got = 0
    while ((getline line < file) > 0) {
        n = split(line, v, " ")
        for (i = 1; i <= n; i++) {
            if (dtype == "F32") data = data f32(v[i] + 0)
            else {
                if (v[i] < 0) { print "expected " name " >= 0, got " v[i] > "/dev/stderr"; exit 1 }
                data = data le(v[i] + 0, 8)
                if (name == "versions" && (oldest == "" || v[i] + 0 < oldest)) oldest = v[i] + 0
            }
        }
        got += n
    }
    close(file)
    if (got != count) { print "expected " count " values of " name ", got " got > "/dev/stderr"; exit 1 }
    size = count * (dtype == "F32" ? 4 : 8)
    tensors = tensors sprintf(",\"%s\":{\"dtype\":\"%s\",\"shape\":[%s],\"data_offsets\":[%d,%d]}",
                              name, dtype, shape, offset, offset + size)
    offset += size
}
BEGIN {
    for (i = 0; i < 256; i++) OCT[i] = sprintf("\\%03o", i)
    for (i = 32; i < 127; i++) ORD[sprintf("%c", i)] = i
    add("obs", "F32", (T + 1) "," E ",4", (T + 1) * E * 4)
    add("actions", "I64", T "," E, T * E)
    add("logp", "F32", T "," E, T * E)
    add("rewards", "F32", T "," E, T * E)
    add("dones", "F32", T "," E, T * E)
    add("versions", "I64", T "," E, T * E)
    while ((getline line < (dir "/returns")) > 0) returns = returns (returns == "" ? "" : ",") line
    header = sprintf("{\"__metadata__\":{\"version\":\"%d\",\"episode_returns\":\"[%s]\",\"actor\":\"%s\"}%s}",
                     oldest, returns, actor, tensors)
    while (length(header) % 8) header = header " "
    printf "%s%s%s", le(length(header), 8), text(header), data
}'

# ------------------------------------------------------------------ act, step, send
sent=0 frames=0 episodes=0 returned=0 stale=0 version=0 step=0
while [ "$segments" -eq 0 ] || [ "$sent" -lt "$segments" ]; do
    for f in obs actions logp rewards dones versions returns; do : > "$work/$f"; done
    t=0
    while [ "$t" -lt "$unroll" ]; do
        code=$(http POST "/v2/models/$model/infer" -H 'Content-Type: application/json' \
            --data-binary "@$work/request")
        [ "$code" = 200 ] || fail "POST /v2/models/$model/infer: HTTP $code: $(said)"
        awk -v dir="$work" -v envs="$envs" -v seed="$((seed * 1000003 + step))" "$STEP" "$work/body" "$work/state"
        mv "$work/state.next" "$work/state"
        t=$((t + 1)) step=$((step + 1))
    done
    awk '{ print $1, $2, $3, $4 }' "$work/state" | tr '\n' ' ' >> "$work/obs"   # row T bootstraps
    echo >> "$work/obs"
    escapes=$(awk -v dir="$work" -v T="$unroll" -v E="$envs" -v actor="$name" "$ENCODE")
    # shellcheck disable=SC2059 # the format is the bytes, written as \ooo escapes
    printf "$escapes" > "$work/segment"
    code=$(http POST /rl/v1/segments -H 'Content-Type: application/vnd.safetensors' \
        --data-binary "@$work/segment")
    case $code in
        200)
            version=$(sed -n 's/.*"version": *\([0-9][0-9]*\).*/\1/p' "$work/body")
            sent=$((sent + 1)) frames=$((frames + unroll * envs))
            episodes=$((episodes + $(wc -l < "$work/returns")))
            returned=$(awk -v sum="$returned" '{ sum += $1 } END { print sum }' "$work/returns")
            if [ -n "${ACTOR_KEEP:-}" ]; then
                cp "$work/segment" "$ACTOR_KEEP/seg-$sent.safetensors"
            fi ;;
        409) stale=$((stale + 1)) ;;      # acted by weights too old: dropped (the next acts on the newest)
        410) echo "$me: $name: the learner ended training"; break ;;
        *) fail "POST /rl/v1/segments: HTTP $code: $(said)" ;;
    esac
done
mean=$(awk -v sum="$returned" -v n="$episodes" 'BEGIN { if (n) printf "%.1f", sum / n; else print "-" }')
echo "$me: $name: $frames frames, $sent segments, $episodes episodes (mean return $mean), $stale stale," \
    "learner version $version"
