//! A job as the service tests send it (a graph, its variables, seeded
//! feeds, one fetch), a client and a session opened for one.

use std::collections::BTreeMap;
use std::time::Duration;

use lanes_adaptor::wire::{Reply, Request, SessionId};
use lanes_adaptor::zoo::seeded_feeds;
use lanes_adaptor::{
    Arch, Client, ClientOptions, Graph, Optimizer, SessionSpec, Tensor, VarValues,
};

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
    /// A training step of `arch` at `batch` (SGD with momentum: state
    /// beside the weights), its weights from seed 3 and its feeds from
    /// seed 5.
    pub fn training(arch: &Arch, batch: usize) -> Job {
        let (t, inputs) = arch
            .training(batch, 3, &Optimizer::sgd_momentum(0.01, 0.9, 0.0))
            .unwrap();
        Job {
            graph: t.graph,
            vars: t.vars,
            feeds: seeded_feeds(&inputs, 5, 10).unwrap(),
            fetch: t.loss,
        }
    }

    /// `arch`'s inference at `batch`, its weights from seed 4 and its
    /// feeds from seed 9.
    pub fn inference(arch: &Arch, batch: usize) -> Job {
        let m = arch.inference(batch, 4).unwrap();
        Job {
            feeds: seeded_feeds(&m.inputs, 9, 10).unwrap(),
            graph: m.graph,
            vars: m.vars,
            fetch: m.output,
        }
    }

    /// The feeds as a Run takes them.
    pub fn feeds(&self) -> Vec<(String, Tensor)> {
        self.feeds
            .iter()
            .map(|(n, t)| (n.clone(), t.clone()))
            .collect()
    }
}
