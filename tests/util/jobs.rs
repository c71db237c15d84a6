//! A job as the service tests send it (a graph, its variables, seeded
//! feeds, one fetch), a client and a session opened for one.

use std::collections::BTreeMap;
use std::time::Duration;

use lanes_adaptor::wire::{Reply, Request, SessionId};
use lanes_adaptor::{Client, ClientOptions, Graph, SessionSpec, Tensor, VarValues};

/// A client of `endpoint` named `name` whose requests wait `timeout`.
pub fn client(endpoint: &str, name: &str, timeout: Duration) -> Client {
    Client::connect_with(
        endpoint,
        ClientOptions {
            timeout,
            name: name.into(),
            ..ClientOptions::default()
        },
    )
    .unwrap()
}

/// Opens a session of `spec`.
pub fn open(c: &mut Client, spec: SessionSpec) -> SessionId {
    match c.request(&Request::OpenSession(spec)).unwrap() {
        Reply::SessionOpened { session } => session,
        other => panic!("unexpected reply {other:?}"),
    }
}

pub struct Job {
    pub graph: Graph,
    pub vars: VarValues,
    pub feeds: BTreeMap<String, Tensor>,
    pub fetch: String,
}

impl Job {
    /// The feeds as a Run takes them.
    pub fn feeds(&self) -> Vec<(String, Tensor)> {
        self.feeds
            .iter()
            .map(|(n, t)| (n.clone(), t.clone()))
            .collect()
    }
}
