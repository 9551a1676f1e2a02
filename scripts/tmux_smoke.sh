#!/usr/bin/env bash
# Smoke test of the chat UI as a new user meets it: a fresh home, `duet` in a real terminal (tmux),
# a typed prompt, and checks that the reply text, the readouts and the context meter appear, that the
# layout folds to a readable chat at 80x24, that Esc and Ctrl+Q work, and that the conversation was saved.
#
#   scripts/tmux_smoke.sh                      the bundled demo model
#   scripts/tmux_smoke.sh --model DIR          any other model; arguments go to duet as they are
set -euo pipefail

session="duet-smoke-$$"
home="$(mktemp -d)"
prompt="In the beginning"
cleanup() {
    tmux kill-session -t "$session" 2>/dev/null || true
    rm -rf "$home"
}
trap cleanup EXIT

screen() { tmux capture-pane -t "$session" -p; }
fail() {
    echo "tmux smoke: FAIL: $1" >&2
    screen >&2 || true
    exit 1
}
wait_for() {  # wait_for REGEX SECONDS WHAT
    local deadline=$((SECONDS + $2))
    until screen | grep -Eq "$1"; do
        [ "$SECONDS" -lt "$deadline" ] || fail "$3 did not appear within $2 s"
        sleep 0.5
    done
}

command="DUET_HOME=$(printf %q "$home") duet"
[ "$#" -eq 0 ] || command+="$(printf ' %q' "$@")"  # printf with no arguments still prints ''
tmux new-session -d -s "$session" -x 120 -y 40
tmux set-option -t "$session" remain-on-exit on
tmux respawn-pane -k -t "$session" "$command"

wait_for '[0-9,]+ tokens$|Could not load' 120 "the loaded model"
screen | grep -q 'Could not load' && fail "the model did not load"
tmux send-keys -t "$session" "$prompt" Enter
wait_for "^.*You.*$" 10 "the user's message"
wait_for 'duet · .* tok/s' 120 "a reply with its speed"
tmux send-keys -t "$session" Escape  # stops the reply if it is still running
sleep 1
pane="$(screen)"
grep -Eq 'decode +[0-9.]+ tok/s' <<<"$pane" || fail "the decode tok/s readout"
grep -Eq 'prefill +[0-9.]+ tok/s' <<<"$pane" || fail "the prefill readout"
grep -Eq 'first token +[0-9.]+ s' <<<"$pane" || fail "the time to first token"
grep -Eq 'tokens/cycle +[0-9.]+' <<<"$pane" || fail "the tokens per cycle"
grep -Eq 'acceptance +([0-9]+%|—)' <<<"$pane" || fail "the acceptance readout"
grep -Eq 'context [0-9,]+ / [0-9,]+' <<<"$pane" || fail "the context meter"
grep -q "$prompt" <<<"$pane" || fail "the prompt in the conversation"
echo "$pane"

# The common default terminal, 80x24: the side panels fold, the readout takes one line of words, and
# the reply keeps a readable width (a line of at least 50 characters between its borders).
tmux resize-window -t "$session" -x 80 -y 24
sleep 1
pane="$(screen)"
grep -Eq 'tok/s · .*(exact|lossy) · ctx [0-9,]+/[0-9,]+' <<<"$pane" || fail "the one-line readout at 80x24"
awk -F'│' 'NF >= 3 && length($2) >= 50 { found = 1 } END { exit !found }' <<<"$pane" || fail "a reply line of 50 characters at 80x24"
echo "$pane"

tmux send-keys -t "$session" C-q
for _ in $(seq 20); do
    [ "$(tmux display-message -t "$session" -p '#{pane_dead}')" = 1 ] && break
    sleep 0.5
done
[ "$(tmux display-message -t "$session" -p '#{pane_dead}')" = 1 ] || fail "Ctrl+Q did not quit"

DUET_HOME="$home" python3 - "$prompt" <<'PY' || fail "the conversation was not saved"
import sys
from app.settings import user_paths
from app.store import Store

store = Store(user_paths().database)
(conversation,) = store.conversations()
user, reply = store.messages(conversation.id)[:2]
assert user.content == sys.argv[1] and reply.role == "assistant" and reply.stats["generated_tokens"] > 0
print(f"saved: {conversation.title!r}, reply of {reply.stats['generated_tokens']} tokens ({reply.finish_reason})")
PY
echo "tmux smoke: OK"
