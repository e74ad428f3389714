//! What a running sequence sends: each sampled token's text (cut at a stop string) and
//! log-probabilities, the rest of its text stream at the end of a choice, and the next choice
//! started from the prompt's logits.

use std::time::Instant;

use super::Worker;
use super::sequence::{Next, Sequence};
use crate::backend::Backend;
use crate::engine::{Sampled, Sampler, SamplerParams};
use crate::model::tokenizer::TextStream;
use crate::service::api::GenerationRequest;
use crate::service::messages::{Event, Piece, TokenLogprob};

impl<B: Backend> Worker<B> {
    /// The sampler of choice `index`: seeded with `seed + index`.
    pub(super) fn sampler(request: &GenerationRequest, index: usize) -> Sampler {
        let params = SamplerParams {
            seed: request.sampler.seed.wrapping_add(index as u64),
            ..request.sampler.clone()
        };
        Sampler::with_penalties(params, request.penalties.clone())
    }

    fn logprob(&self, s: &Sampled) -> TokenLogprob {
        let piece = |id: u32| {
            let bytes = self
                .tok
                .as_ref()
                .map(|t| t.token_bytes(id, false))
                .unwrap_or_default();
            Piece {
                id,
                text: String::from_utf8_lossy(&bytes).into_owned(),
                bytes,
            }
        };
        TokenLogprob {
            token: piece(s.token),
            logprob: s.logprob,
            top: s.top.iter().map(|&(t, lp)| (piece(t), lp)).collect(),
        }
    }

    /// Sample one token for sequence `i` and send it: the token to evaluate next, or why the
    /// sequence is done.
    pub(super) fn sample(&mut self, i: usize) -> Next {
        let seq = &mut self.active[i];
        if seq.job.events.is_closed() {
            return Next::Done("cancelled");
        }
        let sampled = seq.sampler.choose(&seq.logits, seq.job.request.logprobs);
        let next = sampled.token;
        let eog = self
            .tok
            .as_ref()
            .is_some_and(|t| t.is_end_of_generation(next));
        if eog && !seq.job.request.ignore_eos {
            return Next::Done("stop");
        }
        seq.tokens.push(next);
        seq.generated += 1;
        seq.generated_total += 1;
        self.shared.metrics.generated_tokens.inc();
        let now = Instant::now();
        if seq.generated > 1 {
            self.shared
                .metrics
                .inter_token
                .observe((now - seq.last_token).as_secs_f64());
        }
        seq.last_token = now;
        let mut piece = seq
            .stream
            .as_mut()
            .map(|s| s.push(next))
            .unwrap_or_default();
        let mut stop = None;
        if !seq.job.request.stop.is_empty() {
            let before = seq.text.len();
            seq.text.push_str(&piece);
            if let Some(cut) = seq
                .job
                .request
                .stop
                .iter()
                .filter_map(|s| seq.text.find(s.as_str()))
                .min()
            {
                seq.text.truncate(cut);
                piece = seq.text[before.min(cut)..].to_string();
                stop = Some("stop");
            }
        } else {
            seq.text.push_str(&piece);
        }
        let logprobs = if seq.job.request.logprobs.is_some() {
            let lp = self.logprob(&sampled);
            vec![lp]
        } else {
            Vec::new()
        };
        let seq = &mut self.active[i];
        if (!piece.is_empty() || !logprobs.is_empty())
            && seq
                .job
                .events
                .send(Event::Token {
                    index: seq.choice,
                    text: piece,
                    logprobs,
                })
                .is_err()
        {
            return Next::Done("cancelled");
        }
        if let Some(reason) = stop {
            return Next::Done(reason);
        }
        if seq.generated >= seq.job.request.max_tokens {
            return Next::Done("length");
        }
        let slot = &self.slots[seq.slot];
        if slot.session.position() >= slot.session.context_size() {
            return Next::Done("length");
        }
        Next::Eval(next)
    }

    /// Send what the text stream still holds of the current choice.
    pub(super) fn flush_text(seq: &mut Sequence) {
        if let Some(rest) = seq.stream.as_mut().map(|s| s.finish())
            && !rest.is_empty()
            && seq.job.request.stop.is_empty()
        {
            seq.job
                .events
                .send(Event::Token {
                    index: seq.choice,
                    text: rest.clone(),
                    logprobs: Vec::new(),
                })
                .ok();
            seq.text.push_str(&rest);
        }
    }

    /// Choice `choice` of sequence `i` finished for `reason`: start the next from the prompt.
    pub(super) fn next_choice(&mut self, i: usize, reason: &'static str) {
        let seq = &mut self.active[i];
        Self::flush_text(seq);
        seq.job
            .events
            .send(Event::Finish {
                index: seq.choice,
                finish_reason: reason,
            })
            .ok();
        seq.choice += 1;
        seq.generated = 0;
        seq.tokens.truncate(seq.prompt_tokens);
        seq.text.clear();
        seq.stream = self.tok.clone().map(TextStream::new);
        seq.sampler = Self::sampler(&seq.job.request, seq.choice);
        if let Some(l) = &seq.prompt_logits {
            seq.logits.clone_from(l);
        }
        self.slots[seq.slot].session.truncate(seq.prompt_tokens);
    }
}
