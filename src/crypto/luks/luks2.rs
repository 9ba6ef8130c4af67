//! LUKS2: two copies of a 4096-byte binary header, each followed by its
//! JSON area (hdr_size in all, 16 KiB to 4 MiB), checksummed with SHA-256
//! over both with the checksum field zeroed; the valid copy with the
//! highest seqid wins. The JSON names the keyslots, segments, digests and
//! config; the keyslot areas follow the second copy.

use std::fmt;

use base64::Engine as _;
use serde::Deserialize;
use serde::de::{self, IgnoredAny, MapAccess, SeqAccess, Visitor};
use sha2::{Digest as _, Sha256};

use super::{
    Argon2Variant, Digest, Hash, Header, Kdf, Keyslot, LuksError, Result, SUPPORTED_CIPHER,
    Segment, Source, Version, check_areas, check_digest, check_kdf, check_key_bytes, check_segment,
    corrupt, unsupported,
};

const BIN_LEN: usize = 4096;
/// The header sizes (binary header and JSON area) cryptsetup allows.
const HDR_SIZES: [u64; 9] = [
    16 << 10,
    32 << 10,
    64 << 10,
    128 << 10,
    256 << 10,
    512 << 10,
    1 << 20,
    2 << 20,
    4 << 20,
];
/// How deep the JSON may nest (LUKS2's own objects go 4 deep; tokens,
/// which are ignored, may go a little deeper).
pub const MAX_JSON_DEPTH: usize = 32;
/// The most keyslots, segments, digests or list entries (cryptsetup's
/// limit for keyslots and tokens).
pub const MAX_ENTRIES: usize = 32;

fn be64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().unwrap())
}

/// One checked copy of the header: its seqid, size and JSON text.
struct Copy {
    seqid: u64,
    uuid: String,
    hdr_size: u64,
    json: Vec<u8>,
}

/// Reads and checks the copy at `offset` (0: the primary, magic
/// "LUKS\xba\xbe"; else the secondary, "SKUL\xba\xbe").
fn read_copy<S: Source + ?Sized>(src: &S, offset: u64) -> std::result::Result<Copy, String> {
    let mut bin = vec![0u8; BIN_LEN];
    src.read_exact_at(&mut bin, offset)
        .map_err(|e| format!("binary header truncated ({e})"))?;
    let magic: &[u8] = if offset == 0 {
        b"LUKS\xba\xbe"
    } else {
        b"SKUL\xba\xbe"
    };
    if &bin[..6] != magic {
        return Err("no LUKS2 magic".into());
    }
    let version = u16::from_be_bytes([bin[6], bin[7]]);
    if version != 2 {
        return Err(format!("version {version}, not 2"));
    }
    let hdr_size = be64(&bin, 8);
    if !HDR_SIZES.contains(&hdr_size) {
        return Err(format!(
            "header size {hdr_size} (a power of two from 16 KiB to 4 MiB)"
        ));
    }
    if be64(&bin, 256) != offset {
        return Err(format!(
            "header says it is at {}, found at {offset}",
            be64(&bin, 256)
        ));
    }
    let alg_end = bin[72..104].iter().position(|&c| c == 0).unwrap_or(32);
    if &bin[72..72 + alg_end] != b"sha256" {
        return Err(format!(
            "checksum algorithm {:?} (supported: sha256)",
            String::from_utf8_lossy(&bin[72..72 + alg_end])
        ));
    }
    let mut json = vec![0u8; hdr_size as usize - BIN_LEN];
    src.read_exact_at(&mut json, offset + BIN_LEN as u64)
        .map_err(|e| format!("JSON area truncated ({e})"))?;
    let mut stored = [0u8; 64];
    stored.copy_from_slice(&bin[448..512]);
    bin[448..512].fill(0);
    let mut h = Sha256::new();
    h.update(&bin);
    h.update(&json);
    let sum = h.finalize();
    if sum.as_slice() != &stored[..32] {
        return Err("checksum mismatch".into());
    }
    let uuid_end = bin[168..208].iter().position(|&c| c == 0).unwrap_or(40);
    Ok(Copy {
        seqid: be64(&bin, 16),
        uuid: String::from_utf8_lossy(&bin[168..168 + uuid_end]).into_owned(),
        hdr_size,
        json,
    })
}

/// Picks the valid copy with the highest seqid: the primary at 0 and the
/// secondary after it, or, with the primary unreadable, a secondary at
/// any offset cryptsetup may put it.
fn pick<S: Source + ?Sized>(src: &S) -> Result<Copy> {
    match read_copy(src, 0) {
        Ok(primary) => match read_copy(src, primary.hdr_size) {
            Ok(secondary) if secondary.seqid > primary.seqid => Ok(secondary),
            _ => Ok(primary),
        },
        Err(primary_err) => {
            let mut magic_seen = primary_err != "no LUKS2 magic";
            for off in HDR_SIZES {
                let mut m = [0u8; 6];
                if src.read_exact_at(&mut m, off).is_ok() && &m == b"SKUL\xba\xbe" {
                    magic_seen = true;
                    if let Ok(c) = read_copy(src, off) {
                        return Ok(c);
                    }
                }
            }
            if magic_seen {
                Err(corrupt(format!(
                    "LUKS2 primary header: {primary_err}; no valid secondary header"
                )))
            } else {
                Err(LuksError::NotLuks("no LUKS magic".into()))
            }
        }
    }
}

/// The deepest nesting of objects and arrays in `json` (outside strings).
fn depth(json: &[u8]) -> usize {
    let (mut d, mut max, mut in_str, mut esc) = (0usize, 0usize, false, false);
    for &c in json {
        if in_str {
            match (esc, c) {
                (true, _) => esc = false,
                (false, b'\\') => esc = true,
                (false, b'"') => in_str = false,
                _ => {}
            }
            continue;
        }
        match c {
            b'"' => in_str = true,
            b'{' | b'[' => {
                d += 1;
                max = max.max(d);
            }
            b'}' | b']' => d = d.saturating_sub(1),
            _ => {}
        }
    }
    max
}

pub fn parse<S: Source + ?Sized>(src: &S) -> Result<Header> {
    let copy = pick(src)?;
    let text_len = copy
        .json
        .iter()
        .position(|&c| c == 0)
        .ok_or_else(|| corrupt("JSON area is not NUL-terminated"))?;
    let text = &copy.json[..text_len];
    let d = depth(text);
    if d > MAX_JSON_DEPTH {
        return Err(corrupt(format!(
            "JSON nests {d} deep (at most {MAX_JSON_DEPTH})"
        )));
    }
    let j: Json = serde_json::from_slice(text).map_err(|e| corrupt(format!("JSON: {e}")))?;
    drop(copy.json);
    let mut h = build(j, copy.hdr_size, src.len())?;
    h.uuid = copy.uuid;
    Ok(h)
}

fn build(j: Json, hdr_size: u64, src_len: u64) -> Result<Header> {
    if j.config.json_size != hdr_size - BIN_LEN as u64 {
        return Err(corrupt(format!(
            "config.json_size {} disagrees with the header size {hdr_size}",
            j.config.json_size
        )));
    }
    let reqs = j
        .config
        .requirements
        .and_then(|r| r.mandatory)
        .unwrap_or_default();
    if !reqs.is_empty() {
        return Err(unsupported(format!(
            "mandatory requirements {} (a reencryption in progress, or a feature this reader lacks; \
             finish it with cryptsetup first)",
            reqs.join(", ").chars().take(200).collect::<String>()
        )));
    }
    if j.keyslots.iter().any(|(_, k)| k.kind == "reencrypt") {
        return Err(unsupported(
            "a reencryption keyslot (reencryption in progress; finish it with cryptsetup first)",
        ));
    }

    // The data segment: exactly one, crypt, aes-xts-plain64.
    let (seg_id, seg) = match j.segments.as_slice() {
        [one] => one,
        [] => return Err(corrupt("no data segment")),
        more => {
            return Err(unsupported(format!(
                "{} data segments (supported: one; more means a reencryption)",
                more.len()
            )));
        }
    };
    if seg.kind != "crypt" {
        return Err(unsupported(format!(
            "segment {seg_id} of type {:?} (supported: crypt)",
            seg.kind
        )));
    }
    if seg.integrity.is_some() {
        return Err(unsupported(format!(
            "segment {seg_id} has integrity protection (authenticated encryption; \
             supported: {SUPPORTED_CIPHER} without integrity)"
        )));
    }
    let encryption = seg.encryption.as_deref().unwrap_or("");
    if encryption != "aes-xts-plain64" {
        return Err(unsupported(format!(
            "segment {seg_id} cipher {encryption} (supported: {SUPPORTED_CIPHER})"
        )));
    }
    let sector_size = match seg.sector_size {
        Some(s @ (512 | 4096)) => s as u32,
        other => {
            return Err(unsupported(format!(
                "segment {seg_id} sector size {} (supported: 512 and 4096)",
                other.map_or("missing".to_string(), |s| s.to_string())
            )));
        }
    };
    let size = match seg.size.as_str() {
        "dynamic" => None,
        s => Some(
            s.parse::<u64>()
                .map_err(|_| corrupt(format!("segment {seg_id} size {s:?}")))?,
        ),
    };

    // Digests of this segment's volume key.
    let mut digests = Vec::new();
    let mut digest_of_slot: Vec<(String, usize)> = Vec::new();
    for (id, d) in &j.digests {
        if !d.segments.iter().any(|s| s == seg_id) {
            continue;
        }
        if d.kind != "pbkdf2" {
            return Err(unsupported(format!(
                "digest {id} of type {:?} (supported: pbkdf2)",
                d.kind
            )));
        }
        let field = |name: &str| corrupt(format!("digest {id}: no {name}"));
        let digest = Digest {
            hash: Hash::parse(d.hash.as_deref().ok_or_else(|| field("hash"))?)
                .map_err(|e| unsupported(format!("digest {id}: {e}")))?,
            iterations: clamp32(d.iterations.ok_or_else(|| field("iterations"))?),
            salt: b64(
                d.salt.as_deref().ok_or_else(|| field("salt"))?,
                "digest salt",
            )?,
            digest: b64(
                d.digest.as_deref().ok_or_else(|| field("digest"))?,
                "digest",
            )?,
        };
        check_digest(&digest)?;
        for k in &d.keyslots {
            digest_of_slot.push((k.clone(), digests.len()));
        }
        digests.push(digest);
    }
    if digests.is_empty() {
        return Err(corrupt(format!("no digest for segment {seg_id}")));
    }

    // Keyslots bound to the segment's digest; an unbound one (a key not
    // for this segment) cannot open it and is left out.
    let mut key_bytes = None;
    let mut keyslots = Vec::new();
    for (id, k) in &j.keyslots {
        let slot: u32 = id
            .parse()
            .ok()
            .filter(|&n: &u32| (n as usize) < MAX_ENTRIES)
            .ok_or_else(|| corrupt(format!("keyslot id {id:?}")))?;
        let Some(&(_, digest)) = digest_of_slot.iter().find(|(s, _)| s == id) else {
            continue;
        };
        let ks = keyslot(slot, k, digest)?;
        let kb = check_key_bytes(&format!("keyslot {slot} volume"), k.key_size.unwrap_or(0))?;
        if *key_bytes.get_or_insert(kb) != kb {
            return Err(corrupt(format!(
                "keyslot {slot} holds a {kb}-byte key, another one a {}-byte key",
                key_bytes.unwrap_or(0)
            )));
        }
        keyslots.push(ks);
    }
    let Some(key_bytes) = key_bytes else {
        return Err(unsupported(format!("no keyslot opens segment {seg_id}")));
    };
    let metadata_end = (2 * hdr_size)
        .checked_add(j.config.keyslots_size)
        .ok_or_else(|| corrupt("config.keyslots_size overflows"))?;
    let segment = Segment {
        offset: seg.offset,
        size,
        sector_size,
        iv_tweak: seg.iv_tweak.unwrap_or(0),
        key_bytes,
    };
    check_segment(&segment, metadata_end, src_len)?;
    check_areas(&keyslots, key_bytes, 2 * hdr_size, metadata_end, src_len)?;
    Ok(Header {
        version: Version::Luks2,
        uuid: String::new(),
        segment,
        keyslots,
        digests,
    })
}

fn clamp32(v: u64) -> u32 {
    u32::try_from(v).unwrap_or(u32::MAX)
}

fn b64(s: &str, what: &str) -> Result<Vec<u8>> {
    if s.len() > 128 {
        return Err(corrupt(format!("{what}: {} base64 characters", s.len())));
    }
    base64::engine::general_purpose::STANDARD
        .decode(s)
        .map_err(|e| corrupt(format!("{what}: base64: {e}")))
}

fn keyslot(slot: u32, k: &JKeyslot, digest: usize) -> Result<Keyslot> {
    let field = |name: &str| corrupt(format!("keyslot {slot}: no {name}"));
    if k.kind != "luks2" {
        return Err(unsupported(format!(
            "keyslot {slot} of type {:?} (supported: luks2)",
            k.kind
        )));
    }
    let af = k.af.as_ref().ok_or_else(|| field("af"))?;
    if af.kind != "luks1" {
        return Err(unsupported(format!(
            "keyslot {slot}: anti-forensic type {:?} (supported: luks1)",
            af.kind
        )));
    }
    let af_hash =
        Hash::parse(&af.hash).map_err(|e| unsupported(format!("keyslot {slot} AF: {e}")))?;
    let area = k.area.as_ref().ok_or_else(|| field("area"))?;
    if area.kind != "raw" {
        return Err(unsupported(format!(
            "keyslot {slot}: area type {:?} (supported: raw)",
            area.kind
        )));
    }
    let enc = area.encryption.as_deref().unwrap_or("");
    if enc != "aes-xts-plain64" {
        return Err(unsupported(format!(
            "keyslot {slot} cipher {enc} (supported: {SUPPORTED_CIPHER})"
        )));
    }
    let area_key_bytes =
        check_key_bytes(&format!("keyslot {slot} area"), area.key_size.unwrap_or(0))?;
    let kdf_j = k.kdf.as_ref().ok_or_else(|| field("kdf"))?;
    let kdf = match kdf_j.kind.as_str() {
        "pbkdf2" => Kdf::Pbkdf2 {
            hash: Hash::parse(kdf_j.hash.as_deref().ok_or_else(|| field("kdf hash"))?)
                .map_err(|e| unsupported(format!("keyslot {slot} PBKDF2: {e}")))?,
            iterations: clamp32(kdf_j.iterations.ok_or_else(|| field("kdf iterations"))?),
        },
        "argon2i" | "argon2id" => Kdf::Argon2 {
            variant: if kdf_j.kind == "argon2i" {
                Argon2Variant::Argon2i
            } else {
                Argon2Variant::Argon2id
            },
            time: clamp32(kdf_j.time.ok_or_else(|| field("kdf time"))?),
            memory_kib: clamp32(kdf_j.memory.ok_or_else(|| field("kdf memory"))?),
            lanes: clamp32(kdf_j.cpus.ok_or_else(|| field("kdf cpus"))?),
        },
        other => {
            return Err(unsupported(format!(
                "keyslot {slot}: KDF {other:?} (supported: pbkdf2, argon2i, argon2id)"
            )));
        }
    };
    check_kdf(slot, &kdf)?;
    let salt = b64(&kdf_j.salt, "keyslot salt")?;
    if salt.is_empty() || salt.len() > 64 {
        return Err(corrupt(format!(
            "keyslot {slot}: a {}-byte salt (1 to 64)",
            salt.len()
        )));
    }
    let priority = match k.priority {
        None | Some(1) => 1,
        Some(0) => 0,
        Some(2) => 2,
        Some(p) => return Err(corrupt(format!("keyslot {slot}: priority {p} (0 to 2)"))),
    };
    Ok(Keyslot {
        id: slot,
        priority,
        kdf,
        salt,
        area_offset: area.offset,
        area_size: area.size,
        area_key_bytes,
        stripes: clamp32(af.stripes),
        af_hash,
        digest,
    })
}

// The JSON, typed: unknown fields are skipped without being kept, maps
// and lists are bounded, 64-bit numbers are decimal strings.

#[derive(Deserialize)]
struct Json {
    #[serde(deserialize_with = "bounded_map")]
    keyslots: Vec<(String, JKeyslot)>,
    #[serde(deserialize_with = "bounded_map")]
    segments: Vec<(String, JSegment)>,
    #[serde(deserialize_with = "bounded_map")]
    digests: Vec<(String, JDigest)>,
    config: JConfig,
}

#[derive(Deserialize)]
struct JKeyslot {
    #[serde(rename = "type")]
    kind: String,
    key_size: Option<u64>,
    af: Option<JAf>,
    area: Option<JArea>,
    kdf: Option<JKdf>,
    priority: Option<u64>,
}

#[derive(Deserialize)]
struct JAf {
    #[serde(rename = "type")]
    kind: String,
    stripes: u64,
    hash: String,
}

#[derive(Deserialize)]
struct JArea {
    #[serde(rename = "type")]
    kind: String,
    #[serde(deserialize_with = "str_u64")]
    offset: u64,
    #[serde(deserialize_with = "str_u64")]
    size: u64,
    encryption: Option<String>,
    key_size: Option<u64>,
}

#[derive(Deserialize)]
struct JKdf {
    #[serde(rename = "type")]
    kind: String,
    hash: Option<String>,
    iterations: Option<u64>,
    time: Option<u64>,
    memory: Option<u64>,
    cpus: Option<u64>,
    salt: String,
}

#[derive(Deserialize)]
struct JSegment {
    #[serde(rename = "type")]
    kind: String,
    #[serde(deserialize_with = "str_u64")]
    offset: u64,
    size: String,
    #[serde(default, deserialize_with = "opt_str_u64")]
    iv_tweak: Option<u64>,
    encryption: Option<String>,
    sector_size: Option<u64>,
    integrity: Option<IgnoredAny>,
}

#[derive(Deserialize)]
struct JDigest {
    #[serde(rename = "type")]
    kind: String,
    #[serde(deserialize_with = "bounded_list")]
    keyslots: Vec<String>,
    #[serde(deserialize_with = "bounded_list")]
    segments: Vec<String>,
    hash: Option<String>,
    iterations: Option<u64>,
    salt: Option<String>,
    digest: Option<String>,
}

#[derive(Deserialize)]
struct JConfig {
    #[serde(deserialize_with = "str_u64")]
    json_size: u64,
    #[serde(deserialize_with = "str_u64")]
    keyslots_size: u64,
    requirements: Option<JRequirements>,
}

#[derive(Deserialize)]
struct JRequirements {
    #[serde(default, deserialize_with = "opt_bounded_list")]
    mandatory: Option<Vec<String>>,
}

fn str_u64<'de, D: de::Deserializer<'de>>(d: D) -> std::result::Result<u64, D::Error> {
    let s = String::deserialize(d)?;
    s.parse()
        .map_err(|_| de::Error::custom(format!("{s:?} is not a decimal 64-bit number")))
}

fn opt_str_u64<'de, D: de::Deserializer<'de>>(d: D) -> std::result::Result<Option<u64>, D::Error> {
    str_u64(d).map(Some)
}

fn bounded_map<'de, D, T>(d: D) -> std::result::Result<Vec<(String, T)>, D::Error>
where
    D: de::Deserializer<'de>,
    T: Deserialize<'de>,
{
    struct V<T>(std::marker::PhantomData<T>);
    impl<'de, T: Deserialize<'de>> Visitor<'de> for V<T> {
        type Value = Vec<(String, T)>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            write!(f, "an object of at most {MAX_ENTRIES} entries")
        }
        fn visit_map<A: MapAccess<'de>>(
            self,
            mut m: A,
        ) -> std::result::Result<Self::Value, A::Error> {
            let mut out = Vec::new();
            while let Some(k) = m.next_key::<String>()? {
                if out.len() == MAX_ENTRIES {
                    return Err(de::Error::custom(format!(
                        "more than {MAX_ENTRIES} entries"
                    )));
                }
                out.push((k, m.next_value()?));
            }
            Ok(out)
        }
    }
    d.deserialize_map(V(std::marker::PhantomData))
}

fn bounded_list<'de, D: de::Deserializer<'de>>(d: D) -> std::result::Result<Vec<String>, D::Error> {
    struct V;
    impl<'de> Visitor<'de> for V {
        type Value = Vec<String>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            write!(f, "a list of at most {MAX_ENTRIES} strings")
        }
        fn visit_seq<A: SeqAccess<'de>>(
            self,
            mut s: A,
        ) -> std::result::Result<Self::Value, A::Error> {
            let mut out = Vec::new();
            while let Some(v) = s.next_element::<String>()? {
                if out.len() == MAX_ENTRIES {
                    return Err(de::Error::custom(format!(
                        "more than {MAX_ENTRIES} list entries"
                    )));
                }
                out.push(v);
            }
            Ok(out)
        }
    }
    d.deserialize_seq(V)
}

fn opt_bounded_list<'de, D: de::Deserializer<'de>>(
    d: D,
) -> std::result::Result<Option<Vec<String>>, D::Error> {
    bounded_list(d).map(Some)
}
