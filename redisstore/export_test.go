package redisstore

// Slot is slot, for the test that compares it with the cluster's.
var Slot = slot
