#!/usr/bin/env bash
# Sample producer for docker-compose.yml: commits one outbox event per
# transaction, alternating orders.created and payments.settled, forever.
# Connection from the standard PG* variables; RATE_SLEEP seconds between events.
set -euo pipefail
i=0
while true; do
  i=$((i + 1))
  order="o-$i"
  if (( i % 2 )); then
    topic=orders.created type=OrderCreated
  else
    topic=payments.settled type=PaymentSettled
  fi
  psql -v ON_ERROR_STOP=1 -qAt \
    -v topic="$topic" -v type="$type" -v order="$order" -v amount="$(( (i * 7919) % 20000 + 500 ))" <<'SQL'
INSERT INTO outbox_events (topic, aggregate_type, aggregate_id, event_type, payload)
VALUES (:'topic', 'order', :'order', :'type',
        jsonb_build_object('order_id', :'order', 'amount_cents', :'amount'::int));
SQL
  echo "committed $topic for $order"
  sleep "${RATE_SLEEP:-1}"
done
