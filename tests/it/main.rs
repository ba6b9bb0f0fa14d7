//! Integration tests: the real proxy against real PostgreSQL and a stub upstream on real sockets. One
//! folder per promise; the harness they share is `support/`.

mod support;

mod attacks;
mod conformance;
mod guarantees;
mod in_flight;
mod keys;
mod operators;
mod protocols;
mod quickstart;
mod replay;
mod store;
