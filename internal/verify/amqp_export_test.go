package verify

import amqp "github.com/rabbitmq/amqp091-go"

// SetAMQPAfterAck sets the hook run after each ack the AMQP checker wrote
// without error; the returned function removes it.
func SetAMQPAfterAck(f func(ch *amqp.Channel)) (restore func()) {
	amqpAfterAck = f
	return func() { amqpAfterAck = nil }
}
